"""The layout of a run's workdir: every path in it, its contract (`check`), and the
functions that read and write its config (docs/architecture.md, "The workdir"):

    config.json           the resolved config plus provenance (versions, mesh, fingerprints)
    metrics.jsonl         one JSON object a line with "step" and "split"
    tensorboard/          the same figures
    checkpoints/<step>/   full train state and data position (orbax)
    params/<step>/        a params-only series for averaging
    averaged/<name>/      averaged params (never resumed from, never pruned)
    skipped_checkpoints/  damaged checkpoints moved aside on resume
    vocab/                the SentencePiece model (and a tokenized training split)
    eval/                 what `evaluate` scored, one sentence a line. Confusion matrices
    plots/                what `visualize` draws. The confusion matrices drawn
    profile/              a jax.profiler trace, when asked for

The workdir may be remote (gs://...): config.json and metrics.jsonl go through etils.epath.
"""

from __future__ import annotations

import json
import os
import re

from etils import epath
from ml_collections import ConfigDict

from transformer.util import atomic

CONFIG = "config.json"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
PARAMS_SERIES = "params"
AVERAGED = "averaged"
SKIPPED_CHECKPOINTS = "skipped_checkpoints"
VOCAB = "vocab"
EVAL = "eval"
PLOTS = "plots"
PROFILE = "profile"


def path(workdir: str, *parts: str) -> str:
    """`<workdir>/<part>/...`: use the names above for the first part."""
    return os.path.join(workdir, *parts)


def is_remote(workdir: str) -> bool:
    """Whether `workdir` is a URL (gs://bucket/run) rather than a local directory."""
    return "://" in os.fspath(workdir)


def absolute(workdir: str) -> str:
    """A local `workdir` made absolute (as orbax wants it). A URL (gs://bucket/run) as given,
    less a trailing slash."""
    return workdir.rstrip("/") if is_remote(workdir) else os.path.abspath(workdir)


def write_config(workdir: str, values: dict, provenance: dict) -> None:
    """config.json, atomically (other processes may be reading it): `values` (the resolved
    config as a dict) and `provenance`."""
    atomic.write_atomically(path(workdir, CONFIG),
                            json.dumps(values | {"provenance": provenance}, indent=2))


def read_config_file(workdir: str) -> dict | None:
    """config.json as written (provenance included), or None when there is none."""
    target = path(workdir, CONFIG)
    if not epath.Path(target).exists():
        return None
    if not epath.Path(target).is_file():
        raise ValueError(f"{target} is not a file: remove it or use another --workdir")
    try:
        return json.loads(epath.Path(target).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{target} is damaged ({error.msg} at line {error.lineno}): restore it "
                         f"from a copy or use a new --workdir") from None


def read_run_config(workdir: str) -> dict:
    """config.json of a training run as written (provenance included). One line when
    `workdir` is not a run's directory."""
    if not epath.Path(workdir).is_dir():
        raise ValueError(f"--workdir={workdir} is not a directory: give a training run's workdir")
    values = read_config_file(workdir)
    if values is None:
        raise ValueError(f"{workdir} has no {CONFIG}: not a training workdir (train one with "
                         f"python train.py --workdir={workdir})")
    return values


def load_config(workdir: str) -> ConfigDict:
    """The resolved config a run recorded in `<workdir>/config.json` (without provenance)."""
    values = read_run_config(workdir)
    values.pop("provenance", None)
    return ConfigDict(values)


def recorded_vocabulary(workdir: str) -> str | None:
    """The vocabulary sha256 the run recorded in config.json (None on a fresh run)."""
    try:
        provenance = (read_config_file(workdir) or {}).get("provenance", {})
    except (OSError, ValueError):
        return None
    return vocabulary_sha256(provenance)


def vocabulary_sha256(provenance: dict) -> str | None:
    """The vocabulary sha256 in a config.json's provenance, or None."""
    match = re.search(r"sha256=([0-9a-f]{64})", provenance.get("vocabulary") or "")
    return match.group(1) if match else None


# The contract a finished or running workdir keeps (docs/architecture.md, "The workdir").
TRAIN_METRICS = frozenset({"loss", "learning_rate", "grad_norm", "tokens_per_sec",
                           "data_wait_fraction"})
BLEU_METRICS = frozenset({"bleu", "bleu_signature", "bleu_tok_compound", "bleu_num_sentences"})
CONFIG_KEYS = frozenset({"model", "mesh", "seed", "num_train_steps", "checkpoint_every_steps"})
MESH_AXES = frozenset({"data", "fsdp", "tensor"})
SPLITS = ("train", "validation", "test")


def check(workdir: str) -> list[str]:
    """The ways `workdir` departs from the workdir contract, one line each (empty: none):
    config.json with the top-level keys and mesh axes, metrics.jsonl lines with an int `step`
    (1-based on train lines) and a known `split`, train lines with every train metric, eval lines
    with perplexity beside loss and every BLEU figure beside `bleu`, and checkpoints/ holding only
    steps (and orbax's unfinished saves)."""
    problems = []
    try:
        config = read_config_file(workdir)
    except ValueError as error:
        config = None
        problems = [str(error)]
    if config is None and not problems:
        problems.append(f"{CONFIG} is missing")
    elif config is not None:
        if missing := sorted(CONFIG_KEYS - set(config)):
            problems.append(f"{CONFIG} lacks the keys {missing}")
        if missing := sorted(MESH_AXES - set(config.get("mesh", {}))):
            problems.append(f"{CONFIG}'s mesh lacks the axes {missing}")
    metrics = epath.Path(path(workdir, METRICS))
    if not metrics.is_file():
        return problems + [f"{METRICS} is missing"]
    with metrics.open() as f:
        for number, line in enumerate(f, 1):
            where = f"{METRICS}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                problems.append(f"{where} is not a JSON object")
                continue
            step = record.get("step")
            split = record.get("split")
            if split not in SPLITS:
                problems.append(f"{where}: split {split!r} is not one of {list(SPLITS)}")
            if type(step) is not int or step < (1 if split == "train" else 0):
                problems.append(f"{where}: step {step!r} is not an int >= "
                                f"{1 if split == 'train' else 0}")
            if split == "train" and (missing := sorted(TRAIN_METRICS - set(record))):
                problems.append(f"{where}: the train line lacks {missing}")
            if split in SPLITS[1:] and "loss" in record and "perplexity" not in record \
                    and "accuracy" not in record:
                problems.append(f"{where}: an eval loss without perplexity")
            if "bleu" in record and (missing := sorted(BLEU_METRICS - set(record))):
                problems.append(f"{where}: bleu without {missing}")
    checkpoints = epath.Path(path(workdir, CHECKPOINTS))
    if checkpoints.is_dir():
        strays = sorted(name for name in (entry.name for entry in checkpoints.iterdir())
                        if not name.isdigit() and not name.startswith(".")
                        and "orbax-checkpoint-tmp" not in name)
        if strays:
            problems.append(f"{CHECKPOINTS}/ holds entries that are not steps: {strays[:5]}")
    return problems
