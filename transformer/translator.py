"""The Python API beside the CLIs: load a trained workdir, translate sentences.

    import transformer
    translator = transformer.load("runs/default", average=5)
    translator.translate(["The cat sat on the mat."])

Sentences are SentencePiece-encoded with the run's vocabulary (`<workdir>/vocab/`), followed by
EOS as in training, padded into length buckets (one compiled search per bucket), and decoded with
beam search (the config's `decode.*`: beam 4, alpha 0.6, input length + 50) or greedily.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from ml_collections import ConfigDict

from transformer import checkpoint, decoding, progress
from transformer import workdir as workdir_lib
from transformer.config import resolve
from transformer.data.tokenizer import BOS_ID, EOS_ID
from transformer.model import Transformer, TransformerConfig, cache_can_grow, grow_cache, init_cache

log = logging.getLogger("transformer")
BUCKET = 16  # source (and prompt) lengths are padded up to a multiple of this
DECODE_STAGE = 16  # a staged search's self-attention cache grows by this many positions
# Shorter searches keep the whole cache: attending over a few dozen positions costs less than
# compiling one loop per stage.
MIN_STAGED_LENGTH = 48


def bucket_length(length: int, limit: int) -> int:
    """`length` padded up to a multiple of BUCKET, but not past `limit` (nor below `length`):
    one compiled program per bucket, not one per length."""
    return max(length, min(-(-length // BUCKET) * BUCKET, limit))


@dataclasses.dataclass
class Translator:
    """A trained model, its parameters (host or device arrays) and its tokenizer."""

    config: ConfigDict  # a `Resolved.config`: decode.* settings
    model_config: TransformerConfig
    params: dict
    tokenizer: object  # transformer.data.tokenizer.Tokenizer

    def __post_init__(self):
        self.model = Transformer(self.model_config)
        # Host arrays go to the default device; jax.Arrays (e.g. sharded by training, over
        # several processes) stay where they are.
        self.params = jax.tree.map(
            lambda x: x if isinstance(x, jax.Array) else jax.device_put(x), self.params)

    @property
    def max_source_length(self) -> int:
        """Longest source (in pieces, EOS included) the model's positions allow."""
        return self.model_config.max_len

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Piece ids + EOS per sentence, truncated to the model's max_len (one warning line
        for all: how many, which, and why)."""
        encoded, cut = [], []
        for number, ids in enumerate(self.tokenizer.encode(sentences), 1):
            if len(ids) + 1 > self.max_source_length:
                cut.append(number)
                ids = ids[: self.max_source_length - 1]
            encoded.append(ids + [EOS_ID])
        if cut:
            shown = ", ".join(map(str, cut[:5])) + (", ..." if len(cut) > 5 else "")
            log.warning("%d of %d sentences are longer than the model's max_len=%d pieces "
                        "(EOS included) and were truncated to it (sentence %s)", len(cut),
                        len(sentences), self.max_source_length, shown)
        return encoded

    def num_too_long(self, sentences: list[str]) -> int:
        """How many of `sentences` `encode` truncates."""
        return sum(len(ids) + 1 > self.max_source_length
                   for ids in self.tokenizer.encode(sentences))

    def translate(self, sentences: list[str], *, beam_size: int | None = None,
                  alpha: float | None = None, max_extra_length: int | None = None,
                  batch_size: int = 32, show_progress: bool = True) -> list[str]:
        """Translations of `sentences`, in order (beam_size 1 = greedy). Empty in, empty out.
        More than one batch shows progress on stderr (unless `show_progress` is False)."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        decode_cfg = self.config.decode
        beam_size = int(decode_cfg.beam_size if beam_size is None else beam_size)
        alpha = float(decode_cfg.alpha if alpha is None else alpha)
        extra = int(decode_cfg.max_extra_length if max_extra_length is None
                    else max_extra_length)
        for name, value, ok, want in (("beam_size", beam_size, beam_size >= 1, ">= 1 (1: greedy)"),
                                      ("alpha", alpha, alpha >= 0, ">= 0"),
                                      ("max_extra_length", extra, extra >= 0, ">= 0")):
            if not ok:
                raise ValueError(f"{name}={value} must be {want}")
        out = [""] * len(sentences)
        todo = [i for i, s in enumerate(sentences) if s.strip()]
        encoded = self.encode([sentences[i] for i in todo])
        order = sorted(range(len(todo)), key=lambda j: len(encoded[j]))  # similar lengths
        with progress.bar(len(order), "translating", unit="sentence",
                          show=show_progress and len(order) > batch_size
                          and jax.process_index() == 0) as bar:
            for start in range(0, len(order), batch_size):
                chunk = order[start:start + batch_size]
                ids = self.translate_ids([encoded[j] for j in chunk], beam_size=beam_size,
                                         alpha=alpha, max_extra_length=extra)
                for j, row in zip(chunk, ids, strict=True):
                    out[todo[j]] = self.tokenizer.decode(row)
                bar.update(len(chunk))
        return out

    def translate_ids(self, sources: list[list[int]], *, beam_size: int, alpha: float,
                      max_extra_length: int) -> np.ndarray:
        """Best hypotheses [B, L] for source id lists (EOS included); zeros after EOS. The
        batch is padded to a power of two rows (copies of the first source, dropped after),
        so batches of any size compile a few programs per bucket, not one per size."""
        longest = max(len(s) for s in sources)
        length = bucket_length(longest, self.max_source_length)
        rows = 1 << max(len(sources) - 1, 0).bit_length()
        padded = list(sources) + [sources[0]] * (rows - len(sources))
        inputs = np.zeros((rows, length), np.int32)
        for row, ids in enumerate(padded):
            inputs[row, : len(ids)] = ids
        max_lengths = np.minimum(np.array([len(s) for s in padded]) + max_extra_length,
                                 self.model_config.max_len)
        max_length = int(min(length + max_extra_length, self.model_config.max_len))
        search = _search_fn(self.model, beam_size, float(alpha), max_length,
                            self.model_config.scan_layers)
        tokens = search(self.params, inputs, max_lengths)
        if not tokens.is_fully_addressable:  # params sharded over several processes
            tokens = multihost_utils.process_allgather(tokens, tiled=True)
        return np.asarray(tokens)[:len(sources)]


@functools.lru_cache(maxsize=32)
def _search_fn(model: Transformer, beam_size: int, alpha: float, max_length: int,
               scan_layers: bool):
    """A jitted search `(params, inputs [B, S], max_lengths [B]) -> tokens [B, L]`."""

    def search(params, inputs, max_lengths):
        batch = inputs.shape[0]
        encoded = model.apply({"params": params}, inputs, method="encode")

        def decode_fn(tokens, cache):  # beams share their sentence's encoder keys and values
            return model.apply({"params": params}, encoded, inputs, tokens, cache=cache,
                               method="decode")

        staged = {}
        if cache_can_grow(model.config) and max_length >= MIN_STAGED_LENGTH:
            staged = {"cache_lengths": decoding.stage_lengths(max_length, DECODE_STAGE),
                      "grow_cache": functools.partial(grow_cache, model.config)}
        first_length = staged["cache_lengths"][0] if staged else max_length
        cache = init_cache(model.config, batch * beam_size, first_length)
        bos = jnp.full((batch,), BOS_ID, jnp.int32)
        if beam_size == 1:
            return decoding.greedy_search(decode_fn, cache, bos=bos, max_lengths=max_lengths,
                                          max_length=max_length, eos_id=EOS_ID, **staged)
        seqs, _ = decoding.beam_search(decode_fn, cache, bos=bos, max_lengths=max_lengths,
                                       max_length=max_length, beam_size=beam_size,
                                       alpha=alpha, eos_id=EOS_ID,
                                       cache_batch_axis=1 if scan_layers else 0, **staged)
        return seqs[:, 0]

    return jax.jit(search)


def load(workdir: str, *, step: int | None = None, average: int | None = None) -> Translator:
    """Config, parameters (checkpoint `step`, the latest, or the average of the last
    `average`) and tokenizer of a trained workdir."""
    run = resolve(workdir_lib.load_config(workdir))
    architecture = run.model.architecture
    if architecture != "encoder_decoder":
        raise ValueError(f"{workdir} holds a language model (model.architecture={architecture!r}"
                         f"), not a translation model: continue text with python -m "
                         f"transformer.generate; its perplexity is in metrics.jsonl")
    tokenizer = workdir_lib.load_tokenizer(workdir, run.model.vocab_size)
    params = checkpoint.load_params(workdir, step=step, average=average)
    return Translator(run.config, run.model, params, tokenizer)
