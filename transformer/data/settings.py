"""Checks of the `data` keys that the text sources (translation, language model, text
classification) make alike: each bad setting is one line, the same whichever source reads it.
The rows and the model's fit are checked before any data is read."""

from __future__ import annotations

from transformer.data import tokenizer as tokenizer_lib


def check_rows(max_length: int, batch_size: int, grad_accum_steps: int) -> None:
    """A row holds a token and EOS, and `data.batch_size`, the rows of an update, splits into
    `grad_accum_steps` equal microbatches. Else one line."""
    if int(max_length) < 2:
        raise ValueError(f"data.max_length={max_length} must be >= 2 (a token and EOS)")
    if int(batch_size) < 1 or int(batch_size) % int(grad_accum_steps):
        raise ValueError(f"data.batch_size={batch_size} (rows per update) must be a positive "
                         f"multiple of grad_accum_steps={grad_accum_steps}")


def check_model_fits(cfg) -> None:
    """A text model reads its data as the `data` keys give it: one vocabulary of
    `data.vocab_size` pieces, and rows no longer than `model.max_len` where the positions are
    sinusoidal or learned. Else one line."""
    data = cfg.data
    model = cfg.model
    max_len = int(model.get("max_len", data.max_length))
    if model.get("positional", "sinusoidal") in ("sinusoidal", "learned") and \
            int(data.max_length) > max_len:
        raise ValueError(f"data.max_length={data.max_length} exceeds model.max_len={max_len}")
    if int(model.get("vocab_size", data.vocab_size)) != int(data.vocab_size):
        raise ValueError(f"model.vocab_size={model.vocab_size} differs from "
                         f"data.vocab_size={data.vocab_size}")


def check_vocab_size(tokenizer, vocab_size: int) -> None:
    """The vocabulary has `data.vocab_size` pieces: a trained one always, one given or passed
    in maybe not. Else one line."""
    if tokenizer.vocab_size != int(vocab_size):
        raise tokenizer_lib.VocabularyMismatch(
            f"the tokenizer has {tokenizer.vocab_size} pieces but data.vocab_size={vocab_size}")
