"""Documents from the user's own files: `data.dataset="<format>:<glob>"` (or a glob whose
extension names the format) with format `jsonl` (also `.gz`, `.zst`), `parquet`, `text` (one
document a line; `text_paragraphs`: a blank line between documents) or `arrayrecord` (each
record a JSON object, or UTF-8 text). Paths are local or anything fsspec reaches (`gs://`
with gcsfs installed); each shard is read whole when a batch needs it, never the corpus.

A document is the value of a named field (`data.text_field`, dotted for nested fields such as
`meta.text`). Document ids are global: shard k's rows follow those of shards 0..k-1 (shards
in sorted path order). The training order of epoch e (`FileDocuments.order`) shuffles without
materialising anything per document: a seeded permutation of the shards, cut into windows of
`data.shuffle_window` shards, and within each window a seeded pseudo-random permutation of
its rows (`permutation.Permutation`), so a batch reads from at most a window's shards and a
host holds at most that many shards decoded. With `groups` G > 1 (a language model's
`data.pack_groups`) the corpus is G streams, group g owning the shards k with k % G == g: each
group has its own order of the same kind over its own shards (windows of
max(1, shuffle_window // G) shards), so a process that packs only some groups' rows opens only
those groups' shards.

Rows per shard: parquet's metadata or ArrayRecord's index, else a read of the shard; with
`record_dir` (a run's `<workdir>/vocab/`) the counts are recorded there and reused while the
shards are unchanged.

Bad input is one line naming the file: a glob matching nothing, a missing field (with the
fields the file has), a malformed jsonl line (file:line; `data.skip_bad_lines=True` skips and
counts them instead), a parquet column that is not text, a file without documents, non-UTF-8
bytes, an unreachable remote path.
"""

from __future__ import annotations

import collections
import glob
import io
import json
import logging
import os
import re
import threading

import numpy as np

from transformer.data import records
from transformer.data.permutation import Permutation

log = logging.getLogger("transformer")
FORMATS = ("jsonl", "parquet", "text", "text_paragraphs", "arrayrecord")
_EXTENSIONS = ((".jsonl", "jsonl"), (".json", "jsonl"), (".jsonl.gz", "jsonl"),
               (".json.gz", "jsonl"), (".jsonl.zst", "jsonl"), (".json.zst", "jsonl"),
               (".parquet", "parquet"), (".txt", "text"), (".txt.gz", "text"),
               (".txt.zst", "text"), (".array_record", "arrayrecord"),
               (".arrayrecord", "arrayrecord"))
CACHED_SHARDS = 2  # decoded shards kept per process when data.shuffle_window is smaller
SAMPLE_SHARDS = 32  # shards a sample (vocabulary, mean length) reads at most, whatever the corpus
# What TFDS accepts as a dataset name, [namespace:]name[/config][:x.y.z][/key=value,...]
# (`_NAME_REG` of tensorflow_datasets/core/naming.py); a spec outside it names files.
_TFDS_NAME = re.compile(r"^([\w\-]+:)?[a-zA-Z]\w*(/[\w+\-.]+)?(:(\d+|\*)(\.(\d+|\*)){2})?"
                        r"(/(\w+=[^,]+,?)+)?$")


class BadData(ValueError):
    """A file the source cannot use; the message names it and the fix (one line)."""


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
        if "://" not in spec and not glob.glob(os.path.expanduser(spec)):
            raise BadData(f"{setting}={spec!r} is not a TFDS name and no file matches "
                          f"{os.path.abspath(os.path.expanduser(spec))!r}; check the path, or "
                          f"write it as <format>:<glob> with format one of {', '.join(FORMATS)}")
        raise BadData(f"{setting}={spec!r}: cannot tell the format from the extension; "
                      f"write it as <format>:<glob> with format one of {', '.join(FORMATS)}")
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


def _open(path: str, mode: str = "rb"):
    import fsspec

    return fsspec.open(path, mode, compression="infer")


def _lookup(record, field: str, where: str, *, what: str, setting: str):
    """record[a][b]... for `field` "a.b...", or one line naming what the record has."""
    value = record
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise BadData(f"{where}: no {what} {field!r} (it has {have}); set {setting} to "
                          f"one of them")
        value = value[part]
    return value


def _field(record, field: str, where: str) -> str:
    value = _lookup(record, field, where, what="field",
                    setting="the field setting (data.text_field, ...)")
    if not isinstance(value, str):
        raise BadData(f"{where}: field {field!r} is {type(value).__name__}, not text")
    return value


def _label(record, field: str, where: str) -> int | str:
    value = _lookup(record, field, where, what="label field", setting="data.label_field")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise BadData(f"{where}: label {field!r} is {type(value).__name__}, not an integer or "
                      f"a class name")
    return value


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadData(f"{where}: not UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None


def check_parquet_schema(schema, fields: tuple[str, ...], path: str,
                         label_field: str | None = None) -> None:
    """Each (dotted) field is a string column of a parquet file's schema (the label an integer
    or string one), else one line."""
    import pyarrow as pa

    for field in fields + ((label_field,) if label_field else ()):
        parts = field.split(".")
        if parts[0] not in schema.names:
            raise BadData(f"{path}: no column {parts[0]!r} (it has {schema.names}); "
                          f"set the field setting (data.text_field, ...) to one of them")
        kind = schema.field(parts[0]).type
        for depth, part in enumerate(parts[1:], 1):
            if not pa.types.is_struct(kind) or kind.get_field_index(part) < 0:
                raise BadData(f"{path}: column {'.'.join(parts[:depth])!r} ({kind}) has no "
                              f"field {part!r}")
            kind = kind.field(part).type
        if field == label_field and pa.types.is_integer(kind):
            continue
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise BadData(f"{path}: column {field!r} is {kind}, not a string; choose a text "
                          f"column")


class _Reader:
    """Reads one shard's documents as tuples of the wanted fields."""

    def __init__(self, fmt: str, fields: tuple[str, ...], skip_bad_lines: bool,
                 label_field: str | None = None):
        self.fmt, self.fields, self.skip_bad_lines = fmt, fields, skip_bad_lines
        self.label_field = label_field
        self.skipped = 0
        if label_field and fmt.startswith("text"):
            raise BadData(f"data.label_field={label_field!r}: {fmt} files hold no labels; use "
                          f"jsonl, parquet or arrayrecord")

    def read(self, path: str) -> list[tuple[str, ...]]:
        rows = getattr(self, f"_{self.fmt}")(path)
        if not rows:
            raise BadData(f"{path} has no documents; remove it or fix the glob")
        return rows

    def _record(self, record, where: str) -> tuple:
        texts = tuple(_field(record, f, where) for f in self.fields)
        return texts + (_label(record, self.label_field, where),) if self.label_field else texts

    def _jsonl(self, path: str) -> list[tuple[str, ...]]:
        rows = []
        with _open(path) as f:
            data = f.read()
        for number, line in enumerate(data.split(b"\n"), 1):
            text = _decode(line, f"{path}:{number}").strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                if self.skip_bad_lines:
                    self.skipped += 1
                    continue
                raise BadData(f"{path}:{number}: malformed JSON ({e.msg}); fix the line or "
                              f"set data.skip_bad_lines=True to skip and count such lines"
                              ) from None
            rows.append(self._record(record, f"{path}:{number}"))
        return rows

    def _text(self, path: str) -> list[tuple[str, ...]]:
        with _open(path) as f:
            lines = _decode(f.read(), path).splitlines()
        return [(line,) for line in lines if line.strip()]

    def _text_paragraphs(self, path: str) -> list[tuple[str, ...]]:
        with _open(path) as f:
            text = _decode(f.read(), path)
        paragraphs = (p.strip() for p in text.replace("\r\n", "\n").split("\n\n"))
        return [(p,) for p in paragraphs if p]

    def _parquet(self, path: str) -> list[tuple[str, ...]]:
        import pyarrow.parquet as pq

        with _open(path) as f:
            table = pq.read_table(io.BytesIO(f.read()))
        check_parquet_schema(table.schema, self.fields, path, self.label_field)
        columns = []
        for field in self.fields + ((self.label_field,) if self.label_field else ()):
            parts = field.split(".")
            column = table.column(parts[0]).combine_chunks()
            for part in parts[1:]:
                column = column.field(part)
            columns.append(column.to_pylist())
        return [tuple("" if v is None else v for v in row) for row in zip(*columns, strict=True)]

    def _arrayrecord(self, path: str) -> list[tuple[str, ...]]:
        from array_record.python.array_record_module import ArrayRecordReader

        reader = ArrayRecordReader(path)
        try:
            records = reader.read_all()
        finally:
            reader.close()
        rows = []
        for i, data in enumerate(records):
            text = _decode(data, f"{path} record {i}")
            if text.lstrip().startswith("{"):
                rows.append(self._record(json.loads(text), f"{path} record {i}"))
            else:
                rows.append((text,) * len(self.fields))
        return rows


class FileDocuments:
    """Documents by global id from a glob of shards, and each epoch's training order."""

    def __init__(self, spec: str, *, fields: tuple[str, ...] = ("text",), seed: int = 0,
                 shuffle_window: int = 8, skip_bad_lines: bool = False,
                 setting: str = "data.dataset", label_field: str | None = None,
                 record_dir: str | None = None, groups: int = 1):
        parsed = parse_spec(spec, setting)
        if parsed is None:
            raise BadData(f"{setting}={spec!r} names no files; write <format>:<glob>")
        self.format, self.pattern = parsed
        self.fields, self.seed = tuple(fields), int(seed)
        if int(shuffle_window) < 1:
            raise BadData(f"data.shuffle_window={shuffle_window} must be >= 1")
        self.groups = int(groups)
        self.window = int(shuffle_window) if self.groups == 1 else max(
            1, int(shuffle_window) // self.groups)  # shards per window of one group
        self.paths = expand(self.pattern, setting)
        if self.groups > len(self.paths):
            raise BadData(f"data.pack_groups={self.groups} exceeds the {len(self.paths)} "
                          f"shard(s) of {setting}={spec!r}: each group reads its own shards; "
                          f"lower data.pack_groups or split the corpus into more shards")
        self._reader = _Reader(self.format, self.fields, skip_bad_lines, label_field)
        self._cache: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.counts = self._counts(record_dir)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.name = f"{self.format}:{self.pattern}"
        sizes = [self.group_size(g) for g in range(self.groups)]
        if max(sizes) > 1.1 * min(sizes):
            log.warning("%s: data.pack_groups=%d gives groups of %d to %d documents; each group "
                        "draws the same share of an update, so the smaller ones repeat their "
                        "documents sooner: choose a G dividing the %d shards of equal size",
                        self.name, self.groups, min(sizes), max(sizes), len(self.paths))
        if self._reader.skipped:
            log.warning("%s: skipped %d malformed lines", self.name, self._reader.skipped)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def skipped_lines(self) -> int:
        return self._reader.skipped

    def _counts(self, record_dir: str | None) -> np.ndarray:
        """Rows of every shard. With `record_dir` (a run's `<workdir>/vocab/`), the record of
        an earlier count there is used while the shards' paths, sizes and modification times
        are unchanged: the processes that follow process 0, and a resumed run, read no shard
        to count."""
        if record_dir is None:
            return np.array([self._count(k) for k in range(len(self.paths))], np.int64)
        import fsspec

        fs = fsspec.core.url_to_fs(self.paths[0])[0]
        stamps = []
        for path in self.paths:
            info = fs.info(path)
            stamps.append([info.get("size"), str(info.get("mtime") or info.get("updated")
                                                 or info.get("LastModified") or "")])
        reader = self._reader
        record = records.Record(record_dir, "rows", [
            self.format, self.pattern, self.fields, reader.skip_bad_lines, reader.label_field])
        kept = record.read()
        if kept and kept["paths"] == self.paths and kept["stamps"] == stamps:
            reader.skipped = kept["skipped"]
            return np.array(kept["counts"], np.int64)
        counts = np.array([self._count(k) for k in range(len(self.paths))], np.int64)
        record.write({"paths": self.paths, "stamps": stamps, "counts": counts.tolist(),
                      "skipped": reader.skipped})
        return counts

    def _count(self, k: int) -> int:
        """Rows of shard k: parquet's metadata or ArrayRecord's index, else a read of the shard
        (not kept: memory stays that of the cached shards whatever the corpus)."""
        path = self.paths[k]
        if self.format == "arrayrecord":
            from array_record.python.array_record_module import ArrayRecordReader

            reader = ArrayRecordReader(path)
            try:
                rows = reader.num_records()
            finally:
                reader.close()
            if not rows:
                raise BadData(f"{path} has no documents; remove it or fix the glob")
            return rows
        if self.format == "parquet":
            import pyarrow.parquet as pq

            with _open(path) as f:
                parquet = pq.ParquetFile(f)
                check_parquet_schema(parquet.schema_arrow, self.fields, path,
                                     self._reader.label_field)
                rows = parquet.metadata.num_rows
            if not rows:
                raise BadData(f"{path} has no documents; remove it or fix the glob")
            return rows
        return len(self._reader.read(path))

    def _shard(self, k: int) -> list[tuple[str, ...]]:
        with self._lock:
            if k in self._cache:
                self._cache.move_to_end(k)
                return self._cache[k]
        rows = self._reader.read(self.paths[k])
        with self._lock:
            self._cache[k] = rows
            while len(self._cache) > max(CACHED_SHARDS, self.window * self.groups):
                self._cache.popitem(last=False)
        return rows

    def records(self, ids) -> list[tuple[str, ...]]:
        """The field tuples of global documents `ids`."""
        ids = np.asarray(ids, np.int64)
        shards = np.searchsorted(self.offsets, ids, side="right") - 1
        out = [None] * len(ids)
        for k in np.unique(shards):
            rows = self._shard(int(k))
            for i in np.flatnonzero(shards == k):
                out[i] = rows[int(ids[i] - self.offsets[k])]
        return out

    def split(self, names: tuple[str, ...]) -> Split:
        """This source as a random-access split of dicts {name: field} (what
        `datasets.read_pairs` reads)."""
        return Split(self, names)

    def texts(self, ids) -> list[str]:
        return [r[0] for r in self.records(ids)]

    def sample(self, count: int, key: tuple[int, ...]) -> np.ndarray:
        """At most `count` distinct document ids, sorted, drawn with seed (seed, *key) from
        `SAMPLE_SHARDS` shards chosen with the same seed (every shard when there are no more):
        reading a sample costs those shards' decoding whatever the corpus' size."""
        if len(self.paths) <= SAMPLE_SHARDS:
            count = min(count, len(self))
            return np.sort(Permutation(len(self), (self.seed, *key))(np.arange(count)))
        shards = np.sort(Permutation(len(self.paths), (self.seed, *key, 1))(
            np.arange(SAMPLE_SHARDS)))
        starts = np.concatenate([[0], np.cumsum(self.counts[shards])])
        count = min(count, int(starts[-1]))
        positions = Permutation(int(starts[-1]), (self.seed, *key))(np.arange(count))
        slot = np.searchsorted(starts, positions, side="right") - 1
        return np.sort(self.offsets[shards[slot]] + positions - starts[slot])

    def group_size(self, group: int) -> int:
        """Documents of group `group`'s shards (all of them with one group)."""
        return int(self.counts[group::self.groups].sum())

    def order(self, epoch: int, positions, group: int = 0) -> np.ndarray:
        """The global ids at `positions` of epoch `epoch`'s training order of group `group`'s
        shards (see the module docstring): shards permuted, cut into windows, rows permuted
        within each window."""
        positions = np.asarray(positions, np.int64)
        shards = np.arange(group, len(self.paths), self.groups)
        salt = () if self.groups == 1 else (self.groups, group)
        shard_order = shards[Permutation(len(shards), (self.seed, epoch, 0, *salt))(
            np.arange(len(shards)))]
        counts = self.counts[shard_order]
        window_of = np.arange(len(shard_order)) // self.window
        window_sizes = np.bincount(window_of, weights=counts).astype(np.int64)
        window_starts = np.concatenate([[0], np.cumsum(window_sizes)])
        windows = np.searchsorted(window_starts, positions, side="right") - 1
        ids = np.empty_like(positions)
        for w in np.unique(windows):
            here = windows == w
            inner = Permutation(int(window_sizes[w]), (self.seed, epoch, 1, int(w), *salt))(
                positions[here] - window_starts[w])
            members = shard_order[window_of == w]
            member_starts = np.concatenate([[0], np.cumsum(self.counts[members])])
            slot = np.searchsorted(member_starts, inner, side="right") - 1
            ids[here] = self.offsets[members[slot]] + inner - member_starts[slot]
        return ids

    def draw(self, start: int, stop: int, group: int = 0) -> np.ndarray:
        """Positions [start, stop) of group `group`'s endless order (epoch after epoch)."""
        positions = np.arange(start, stop, dtype=np.int64)
        epochs, inner = np.divmod(positions, self.group_size(group))
        ids = np.empty_like(positions)
        for e in np.unique(epochs):
            ids[epochs == e] = self.order(int(e), inner[epochs == e], group)
        return ids


class Split:
    """Records of a `FileDocuments` as dicts keyed by `names` (one per field), by index."""

    def __init__(self, documents: FileDocuments, names: tuple[str, ...]):
        self.documents, self.names = documents, names

    def __len__(self) -> int:
        return len(self.documents)

    def __getitems__(self, ids) -> list[dict[str, str]]:
        return [dict(zip(self.names, r, strict=True)) for r in self.documents.records(ids)]

    def __getitem__(self, i: int) -> dict[str, str]:
        return self.__getitems__([i])[0]
