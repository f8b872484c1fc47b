"""The checkpoint's own tokenizer files that an import keeps in the run's vocab/ for the export
to write back: an OPUS-MT Marian's `source.spm`, `target.spm` and `vocab.json` (the run's
vocabulary is a `tokenizer.json` with our ids: `marian.keep_vocabulary`), T5's `spiece.model`.
A run fine-tuned from the import (`init_from`, which copies the vocabulary file alone) finds
them through its `init_from` chain. Each export checks that the run's vocabulary is still the
one they give (`marian.opus_ids`, `t5.check_spiece`), before anything is written."""

from __future__ import annotations

import json
import os
import shutil

from transformer.checkpoint import layout
from transformer.data import tokenizer as tokenizer_lib
from transformer.huggingface import families, marian, t5
from transformer.model.config import TransformerConfig
from transformer.training import transfer

GENERATION_CONFIG = "generation_config.json"
NAMES = {families.Marian: marian.SOURCE_SPM, families.T5: t5.SPIECE_FILE}  # what marks them


def files_dir(workdir: str, tokenizer, name: str) -> str:
    """The vocab/ holding the kept file `name`: the run's own, else that of the run it started
    from (init_from), and so on back to the import, while each has the same vocabulary. The
    run's own where none holds it."""
    own = vocab_dir = layout.path(workdir, layout.VOCAB)
    seen = {os.path.abspath(workdir)}
    while tokenizer is not None and not os.path.isfile(os.path.join(vocab_dir, name)):
        spec = (layout.read_config_file(workdir) or {}).get("init_from")
        try:
            workdir = transfer.parse(spec).workdir if spec else None
        except ValueError:  # the run it started from is gone
            workdir = None
        if workdir is None or os.path.abspath(workdir) in seen:
            return own
        seen.add(os.path.abspath(workdir))
        vocab_dir = layout.path(workdir, layout.VOCAB)
        try:
            if tokenizer_lib.load(vocab_dir).sha256 != tokenizer.sha256:
                return own
        except (OSError, ValueError, RuntimeError):
            return own
    return vocab_dir


def checked(workdir: str, tokenizer, cfg: TransformerConfig, family) -> tuple:
    """(the vocab/ with the kept files or None, OPUS-MT's config.json ids or None), the run's
    vocabulary checked against those files (ValueError in one line)."""
    if family not in NAMES:
        return None, None
    vocab_dir = files_dir(workdir, tokenizer, NAMES[family])
    if family is families.T5:
        t5.check_spiece(vocab_dir, tokenizer)
        return vocab_dir, None
    return vocab_dir, marian.opus_ids(vocab_dir, tokenizer, cfg)


def write(vocab_dir: str | None, out_dir: str, opus: dict | None, tokenizer,
          cfg: TransformerConfig) -> None:
    """The kept files into `out_dir`: an OPUS-MT Marian's with its generation_config.json
    (its ids, its pad never generated; the run's further ends in Marian's ids), T5's
    spiece.model. Nothing where none is kept."""
    if opus:
        generation = marian.write_kept_vocabulary(vocab_dir, out_dir, opus, cfg)
        if len(tokenizer.eos_ids) > 1:
            order = marian.opus_order(opus)
            generation["eos_token_id"] = [int(order[i]) for i in tokenizer.eos_ids]
        with open(os.path.join(out_dir, GENERATION_CONFIG), "w") as f:
            json.dump(generation, f, indent=2)
    elif vocab_dir and os.path.isfile(path := os.path.join(vocab_dir, t5.SPIECE_FILE)):
        shutil.copyfile(path, os.path.join(out_dir, t5.SPIECE_FILE))
