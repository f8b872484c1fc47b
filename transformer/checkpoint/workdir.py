"""A run's workdir: every path in it, and the functions that read and write its config and
vocabulary. The layout (DESIGN.md, "The workdir"):

    config.json           the resolved config plus provenance (versions, mesh, fingerprints)
    metrics.jsonl         one JSON object a line with "step" and "split"
    tensorboard/          the same figures
    checkpoints/<step>/   full train state and data position (orbax)
    params/<step>/        a params-only series for averaging
    averaged/<name>/      averaged params (never resumed from, never pruned)
    skipped_checkpoints/  damaged checkpoints moved aside on resume
    vocab/                the SentencePiece model (and a tokenized training split)
    eval/                 what `evaluate` scored, one sentence a line
    plots/                what `visualize` draws
    profile/              a jax.profiler trace, when asked for
"""

from __future__ import annotations

import json
import os
import re

from ml_collections import ConfigDict

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


def write_config(workdir: str, values: dict, provenance: dict) -> None:
    """config.json, atomically (other processes may be reading it): `values` (the resolved
    config as a dict) and `provenance`."""
    target = path(workdir, CONFIG)
    with open(f"{target}.tmp", "w") as f:
        json.dump(values | {"provenance": provenance}, f, indent=2)
    os.replace(f"{target}.tmp", target)


def read_config_file(workdir: str) -> dict | None:
    """config.json as written (provenance included), or None when there is none."""
    target = path(workdir, CONFIG)
    if not os.path.exists(target):
        return None
    if not os.path.isfile(target):
        raise ValueError(f"{target} is not a file: remove it or use another --workdir")
    try:
        with open(target) as f:
            return json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{target} is damaged ({error.msg} at line {error.lineno}): restore it "
                         f"from a copy or use a new --workdir") from None


def load_config(workdir: str) -> ConfigDict:
    """The resolved config a run recorded in `<workdir>/config.json` (without provenance)."""
    if not os.path.isdir(workdir):
        raise ValueError(f"--workdir={workdir} is not a directory: give a training run's workdir")
    values = read_config_file(workdir)
    if values is None:
        raise ValueError(f"{workdir} has no {CONFIG}: not a training workdir (train one with "
                         f"python train.py --workdir={workdir})")
    values.pop("provenance", None)
    return ConfigDict(values)


def recorded_vocabulary(workdir: str) -> str | None:
    """The vocabulary sha256 the run recorded in config.json (None on a fresh run)."""
    try:
        recorded = (read_config_file(workdir) or {}).get("provenance", {}).get("vocabulary")
    except (OSError, ValueError):
        return None
    match = re.search(r"sha256=([0-9a-f]{64})", recorded or "")
    return match.group(1) if match else None


def load_tokenizer(workdir: str, vocab_size: int):
    """The run's vocabulary (`<workdir>/vocab/`: its SentencePiece model, or an imported
    checkpoint's tokenizer.json), refused unless it is the vocabulary the run was trained with
    (`vocab_size` pieces, and the sha256 recorded in config.json)."""
    from transformer.data import tokenizer as tokenizer_lib

    directory = path(workdir, VOCAB)
    vocab = tokenizer_lib.vocabulary_file(directory)
    if not os.path.exists(vocab):
        raise ValueError(f"{vocab} is missing: this run has no vocabulary (was it trained on "
                         f"text, not the synthetic task?)")
    if not os.path.isfile(vocab):
        raise ValueError(f"{vocab} is not a file: restore the run's vocab/ directory")
    kind = ("a tokenizer.json" if vocab.endswith(tokenizer_lib.JSON_FILE)
            else "a SentencePiece model")
    try:
        tokenizer = tokenizer_lib.load(directory)
    except tokenizer_lib.VocabularyMismatch:
        raise
    except (RuntimeError, ValueError, OSError):  # the bytes do not parse as a vocabulary
        raise ValueError(f"{vocab} is damaged (not {kind}): restore the run's vocab/ "
                         f"directory from a copy") from None
    recorded = recorded_vocabulary(workdir)
    if tokenizer.vocab_size != vocab_size or recorded not in (None, tokenizer.sha256):
        raise tokenizer_lib.VocabularyMismatch(
            f"{vocab} ({tokenizer.vocab_size} pieces, sha256 {tokenizer.sha256[:12]}…) is not "
            f"the vocabulary this run was trained with ({vocab_size} pieces"
            f"{f', sha256 {recorded[:12]}…' if recorded else ''} in config.json): restore the "
            f"run's vocab/ directory")
    return tokenizer
