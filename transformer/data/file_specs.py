"""What a `data.dataset` string names when it names files: `<format>:<glob>`, a glob whose
extension names the format, or a directory in the Hugging Face hub's parquet layout
(`<repo>/<config>/<split>-*.parquet`, named bare or as `parquet:<dir>`). Anything else of
TFDS's name grammar is a TFDS dataset. Paths are local or anything fsspec reaches (`gs://`
with gcsfs installed).
"""

from __future__ import annotations

import glob
import os
import re

FORMATS = ("jsonl", "parquet", "text", "text_paragraphs", "arrayrecord")
_EXTENSIONS = ((".jsonl", "jsonl"), (".json", "jsonl"), (".jsonl.gz", "jsonl"),
               (".json.gz", "jsonl"), (".jsonl.zst", "jsonl"), (".json.zst", "jsonl"),
               (".parquet", "parquet"), (".txt", "text"), (".txt.gz", "text"),
               (".txt.zst", "text"), (".array_record", "arrayrecord"),
               (".arrayrecord", "arrayrecord"))
# What TFDS accepts as a dataset name, [namespace:]name[/config][:x.y.z][/key=value,...]
# (`_NAME_REG` of tensorflow_datasets/core/naming.py); a spec outside it names files.
_TFDS_NAME = re.compile(r"^([\w\-]+:)?[a-zA-Z]\w*(/[\w+\-.]+)?(:(\d+|\*)(\.(\d+|\*)){2})?"
                        r"(/(\w+=[^,]+,?)+)?$")


class BadData(ValueError):
    """A file the source cannot use. The message names it and the fix, in one line."""


def parse_spec(spec: str, setting: str = "data.dataset") -> tuple[str, str] | None:
    """(format, glob) when `spec` names files (`<format>:<glob>`, a path with a known
    extension, or a hub-layout directory, bare or as `parquet:<dir>`), else None (a TFDS
    name such as `c4/en:3.0.1`).
    A path that is neither (remote, absolute, or not of TFDS's name grammar) is one line:
    the path matches nothing, or its format needs the `<format>:` prefix."""
    head, sep, rest = spec.partition(":")
    named = head if sep and head in FORMATS else None
    directory = hub_directory(spec) if named in (None, "parquet") else None
    if directory:
        return "parquet", f"{directory}/train-*.parquet"
    if named:
        return named, rest
    inferred = infer_format(spec)
    if inferred:
        return inferred, spec
    if ("://" in spec or spec.startswith(("/", "./", "~")) or not _TFDS_NAME.match(spec)
            or ("/" in spec and os.path.exists(spec))):
        write_as = f"write it as <format>:<glob> with format one of {', '.join(FORMATS)}"
        if "://" not in spec and not glob.glob(os.path.expanduser(spec)):
            raise BadData(f"{setting}={spec!r} is not a TFDS name and no file matches "
                          f"{os.path.abspath(os.path.expanduser(spec))!r}; check the path, or "
                          f"{write_as}")
        raise BadData(f"{setting}={spec!r}: cannot tell the format from the extension; "
                      f"{write_as}")
    return None


def hub_directory(spec: str) -> str | None:
    """The directory `spec` names when it is one (the Hugging Face hub's parquet layout,
    `<repo>/<config>/<split>-*.parquet`, found by split name; local or remote), else None."""
    import fsspec

    head, sep, rest = spec.partition(":")
    path = rest if sep and head in FORMATS else spec
    if any(c in path for c in "*?[") or infer_format(path) or not (
            "/" in path or path.startswith(("~", "."))):
        return None
    try:
        fs, _, roots = fsspec.core.get_fs_token_paths(path)
        return path.rstrip("/") if len(roots) == 1 and fs.isdir(roots[0]) else None
    except Exception:  # not reachable: expand() reports it when the files are read
        return None


def split_spec(spec: str, split: str) -> str | None:
    """The `<format>:<glob>` of a split: a hub-layout directory's `<split>-*.parquet`, else
    None (a glob names one split's files)."""
    directory = hub_directory(spec)
    return f"parquet:{directory}/{split}-*.parquet" if directory else None


def eval_spec(dataset: str, eval_dataset: str | None, split: str) -> str:
    """The files to evaluate on when `dataset` names files: `eval_dataset`, else the
    hub-layout directory's `split`. Else one line."""
    spec = eval_dataset or split_spec(dataset, split)
    if not spec:
        raise ValueError(f"data.dataset={dataset!r} is files: set data.eval_dataset to the "
                         f"files to evaluate on (<format>:<glob>)")
    return spec


def infer_format(path: str) -> str | None:
    path = path.lower()
    for ext, fmt in sorted(_EXTENSIONS, key=lambda e: -len(e[0])):
        if path.endswith(ext):
            return fmt
    return None


def expand(pattern: str, setting: str = "data.dataset") -> list[str]:
    """The sorted paths a glob matches (local or remote), or one line saying why none."""
    import fsspec

    try:
        fs, _, paths = fsspec.core.get_fs_token_paths(pattern)
        if not any(c in pattern for c in "*?["):  # a literal path is returned unchecked
            paths = [p for p in paths if fs.isfile(p)]
    except ImportError as e:
        raise BadData(f"{setting}={pattern!r}: reading it needs {e.name or 'an fsspec backend'} "
                      f"(e.g. pip install gcsfs for gs://)") from None
    except Exception as e:  # credentials, network, permissions: the backend's first line
        raise BadData(f"{setting}={pattern!r}: cannot list it ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else 'no detail'}); check the path "
                      f"and the credentials for it") from None
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    prefix = "" if protocol in ("file", "local") else f"{protocol}://"
    paths = sorted(p if "://" in p or not prefix else prefix + p for p in paths)
    if not paths:
        where = "" if prefix else f" ({os.path.abspath(os.path.expanduser(pattern))!r})"
        raise BadData(f"{setting}={pattern!r} matches no file{where}; check the path")
    return paths
