"""Start a run from another run's parameters: the config key `init_from`.

`init_from` names a training workdir (its latest step), `workdir:step`, or a params directory
inside one (`<workdir>/averaged/<name>`, `<workdir>/checkpoints/<step>`,
`<workdir>/params/<step>`), local or remote (gs://, through etils.epath and orbax). A workdir
that has saved no step is an error before any work. Only parameters are read: the new run's
optimizer state and data position start fresh. Parameters are matched by path. Those the new
model has and the old does not (a classification head, say) keep their fresh
initialisation and are listed in one log line. A shape that differs is an error naming the
parameter and both shapes, except a ViT's `position_embedding`, which is interpolated to the
new patch grid. Per-layer and scanned layouts convert either way. `init_from_exclude`, a regular
expression, leaves the parameters whose path it matches (`re.search`, e.g. `decoder/logits` or
`^decoder/`) fresh too, as fairseq's and T5X's fine-tuning can reset a head. One that matches no
parameter is an error (a typo would otherwise transfer everything).

The vocabulary must be the pretrained run's: its `vocab/` is copied into the new workdir before
the data pipeline would train one, and a new workdir that already holds another vocabulary is
an error. Once the new run has saved a checkpoint, resuming restores that and never reads
`init_from` again (the loop calls `load` only when there is no checkpoint).

Parameters are read into host memory and each array is placed straight into the new run's
sharding (`jax.make_array_from_callback`), so no device ever holds more than its shard.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import textwrap

import jax
import numpy as np
from etils import epath

from transformer.checkpoint import averaging, checkpointer, layout
from transformer.data import tokenizer as tokenizer_lib
from transformer.util import atomic

log = logging.getLogger("transformer")
POSITION_EMBEDDING = "position_embedding"  # a ViT's learned table: resized, not refused


@dataclasses.dataclass(frozen=True)
class InitSource:
    """Where `init_from` points: the run (for its vocabulary) and which of its params."""

    workdir: str
    step: int | None = None  # None: the latest
    params_dir: str | None = None  # an orbax params directory inside `workdir`

    def describe(self) -> str:
        if self.params_dir:
            return self.params_dir
        return self.workdir + ("" if self.step is None else f":{self.step}")


def _run_root(path: str) -> str | None:
    """The training workdir at or above `path` (the first directory holding config.json; in a
    bucket, up to the bucket)."""
    path = layout.absolute(path)
    while True:
        if epath.Path(layout.path(path, layout.CONFIG)).is_file():
            return path
        parent = os.path.dirname(path)
        if parent == path or (layout.is_remote(path) and not layout.is_remote(parent)):
            return None
        path = parent


def _check_saved(spec: str, source: InitSource) -> InitSource:
    """`source`, once its run is known to hold its step (or any step: the latest)."""
    saved = sorted({step for kind in (layout.CHECKPOINTS, layout.PARAMS_SERIES)
                    for step in checkpointer.list_steps(layout.path(source.workdir, kind))})
    if not saved:
        raise ValueError(f"init_from={spec!r}: {source.workdir} holds no checkpoint (no finished "
                         f"step in {layout.CHECKPOINTS}/ or {layout.PARAMS_SERIES}/): "
                         f"give a run that has saved one, or train it first")
    if source.step is not None and source.step not in saved:
        raise ValueError(f"init_from={spec!r}: step {source.step} is not saved in "
                         f"{source.workdir} (it holds {', '.join(map(str, saved))}): give one "
                         f"of those")
    return source


def parse(spec: str) -> InitSource:
    """`init_from` -> InitSource. A path that is none of the three forms is a one-line error."""
    path = spec
    step = None
    match = re.fullmatch(r"(.+):(\d+)", spec)
    if match and not epath.Path(spec).exists():
        path = match.group(1)
        step = int(match.group(2))
    root = _run_root(path) if epath.Path(path).is_dir() else None
    if root is None:
        raise ValueError(f"init_from={spec!r} is not a training workdir (one with "
                         f"{layout.CONFIG}), workdir:step, or a params directory inside one")
    relative = os.path.relpath(layout.absolute(path), root).split(os.sep)
    if relative == ["."]:
        return _check_saved(spec, InitSource(root, step))
    if step is None and len(relative) == 2 and relative[0] == layout.AVERAGED:
        return InitSource(root, params_dir=layout.absolute(path))
    if step is None and len(relative) == 2 and relative[1].isdigit() and relative[0] in (
            layout.CHECKPOINTS, layout.PARAMS_SERIES):
        return _check_saved(spec, InitSource(root, int(relative[1])))
    raise ValueError(f"init_from={spec!r}: give the workdir {root}, {root}:<step>, or a "
                     f"directory of its {layout.AVERAGED}/, {layout.CHECKPOINTS}/ or "
                     f"{layout.PARAMS_SERIES}/")


def copy_vocabulary(source: InitSource, workdir: str, vocab_size: int) -> None:
    """Puts the pretrained run's vocabulary (its SentencePiece model, or an imported
    tokenizer.json, and the files beside it: `tokenizer.FILES`) into `<workdir>/vocab/` (once).
    Not the records of its data kept there, nor a crashed writer's temporary files. Either
    workdir may be remote (gs://)."""
    src_dir = layout.path(source.workdir, layout.VOCAB)
    src = tokenizer_lib.vocabulary_file(src_dir)
    if not epath.Path(src).is_file():
        raise ValueError(f"init_from={source.describe()}: {src} is missing; the pretrained "
                         f"run's vocabulary is needed to fine-tune it")
    pretrained = tokenizer_lib.load(src_dir)
    if pretrained.vocab_size != vocab_size:
        raise ValueError(f"init_from={source.describe()} has a {pretrained.vocab_size}-piece "
                         f"vocabulary but data.vocab_size={vocab_size}: set "
                         f"--config.data.vocab_size={pretrained.vocab_size}")
    target_dir = layout.path(workdir, layout.VOCAB)
    target = tokenizer_lib.vocabulary_file(target_dir)
    if epath.Path(target).is_file():
        if tokenizer_lib.load(target_dir).sha256 != pretrained.sha256:
            raise ValueError(f"{target} is not init_from's vocabulary ({src}): fine-tune in a "
                             f"new --workdir")
        return
    epath.Path(target_dir).mkdir(parents=True, exist_ok=True)
    main_file = os.path.basename(src)
    # the model last, so that a process that finds it finds the rest (others may copy at once)
    for name in sorted(tokenizer_lib.FILES, key=lambda name: name == main_file):
        if (file := epath.Path(src_dir) / name).exists():
            atomic.write_atomically(epath.Path(target_dir) / name, file.read_bytes())


def _read(source: InitSource) -> dict:
    if source.params_dir:
        return averaging.load_averaged(source.params_dir)
    return averaging.load_params(source.workdir, step=source.step)


def _flat(tree) -> dict[str, object]:
    """{path name: leaf}, in the tree's leaf order."""
    return {checkpointer.path_name(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _same_layout(saved: dict, fresh) -> dict:
    """`saved` in the layer layout of `fresh` (scanned `layers` or per-layer `layers_{i}`)."""
    def scanned(tree):
        return any(re.search(r"(^|/)layers/", path) for path in _flat(tree))
    if scanned(fresh) and not scanned(saved):
        return checkpointer.stack_layers(saved)
    if scanned(saved) and not scanned(fresh):
        return checkpointer.unstack_layers(saved)
    return saved


def _resized_table(table: np.ndarray, shape: tuple, has_class_token: bool) -> np.ndarray:
    from transformer.model.vit import resize_position_embeddings

    extra = int(has_class_token)
    old = table.shape[0] - extra
    new = shape[0] - extra
    old_side = math.isqrt(old)
    new_side = math.isqrt(new)
    if old_side ** 2 != old or new_side ** 2 != new:
        raise ValueError(f"init_from: {POSITION_EMBEDDING} {table.shape} -> {shape} is not a "
                         f"square patch grid to interpolate")
    return np.asarray(resize_position_embeddings(table, old_side, new_side, has_class_token))


def _layers(indices: list[int]) -> str:
    """Layer indices as one: `3`, `{0-5}` (a run of them) or `{0,2}`."""
    if len(indices) == 1:
        return str(indices[0])
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"{{{indices[0]}-{indices[-1]}}}"
    return "{" + ",".join(map(str, indices)) + "}"


def _grouped(kind: str, names: list[str]) -> list[str]:
    """`names` for the log: a line per top-level module (wrapped at 100 columns) with its count
    and its sublayers, each once for all the layers that hold it; `/*`: all its parameters
    (`layers_{0-5}/ffn/*`, `logits/kernel`)."""
    modules: dict[str, dict[str, tuple[set[int], set[str]]]] = {}
    counts: dict[str, int] = {}
    for name in names:
        module, _, rest = name.partition("/")
        parts = rest.split("/") if rest else [name]
        layer = re.fullmatch(r"layers_(\d+)|layers", parts[0])  # per-layer or scanned
        depth = 2 if layer and len(parts) > 2 else 1
        if layer and layer.group(1):
            parts[0] = "layers_#"
        indices, leaves = modules.setdefault(module, {}).setdefault(
            "/".join(parts[:depth]), (set(), set()))
        indices.update([int(layer.group(1))] if layer and layer.group(1) else [])
        leaves.add("/".join(parts[depth:]))
        counts[module] = counts.get(module, 0) + 1
    lines = []
    for module, keys in modules.items():
        entries = []
        for key, (indices, leaves) in keys.items():
            key = key.replace("#", _layers(sorted(indices))) if indices else key
            leaf = next(iter(leaves)) if len(leaves) == 1 else "*"
            entries.append(f"{key}/{leaf}" if leaf else key)
        lines += textwrap.wrap(f"{kind} in {module} ({counts[module]}): {', '.join(entries)}",
                               100, initial_indent="  ", subsequent_indent="    ",
                               break_long_words=False, break_on_hyphens=False)
    return lines


def load(source: InitSource, fresh, *, has_class_token: bool = False, exclude: str = ""):
    """`fresh` (the new run's initialised, sharded params) with every parameter the pretrained
    run has, and `exclude` (a regex, checked by `config.resolve`) does not match, replaced by its
    value, placed in the same sharding. Returns (params, the paths left fresh)."""
    saved = _flat(_same_layout(_read(source), fresh))
    wanted = _flat(fresh)
    excluded = {name for name in wanted if exclude and re.search(exclude, name)}
    if exclude and not excluded:
        raise ValueError(f"init_from_exclude={exclude!r} matches no parameter of this "
                         f"model (paths such as {next(iter(wanted))}); fix the expression")
    placed = []
    kept_fresh = []
    for name, leaf in wanted.items():
        if name not in saved or name in excluded:
            kept_fresh.append(name)
            placed.append(leaf)
            continue
        value = np.asarray(saved[name])
        if value.shape != leaf.shape:
            if name.split("/")[-1] != POSITION_EMBEDDING:
                raise ValueError(f"init_from={source.describe()}: {name} has shape "
                                 f"{value.shape} there but {tuple(leaf.shape)} in this model; "
                                 f"fine-tune a model of the same shape")
            value = _resized_table(value, leaf.shape, has_class_token)
        value = value.astype(leaf.dtype)
        placed.append(jax.make_array_from_callback(leaf.shape, leaf.sharding,
                                                   lambda index, v=value: v[index]))
    unused = sorted(set(saved) - set(wanted))
    log.info("init_from %s: %d parameters loaded, %d left fresh, %d not used%s",
             source.describe(), len(wanted) - len(kept_fresh), len(kept_fresh), len(unused),
             "".join("\n" + line for line in [*_grouped("left fresh", kept_fresh),
                                               *_grouped("not used", unused)]))
    return jax.tree.unflatten(jax.tree.structure(fresh), placed), kept_fresh
