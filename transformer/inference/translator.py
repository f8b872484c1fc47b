"""The Python API beside the CLIs: load a trained workdir, translate sentences.

    import transformer
    translator = transformer.load("runs/default", average=5)
    translator.translate(["The cat sat on the mat."])

Sentences are SentencePiece-encoded with the run's vocabulary (`<workdir>/vocab/`), followed by
EOS as in training, padded into length buckets (one compiled search per bucket), and decoded with
beam search (the config's `decode.*`: beam 4, alpha 0.6, input length + 50) or greedily. A
hypothesis ends at EOS or at any further end the vocabulary lists (`eos_ids`: an imported
checkpoint's generation config), as `transformers`' `generate` does. `quantize="int8"` decodes
with int8 attention and feed-forward kernels and an int8 KV cache (`inference/quantize.py`).
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

from transformer.inference import decoding
from transformer.inference.quantize import check_quantize, dequantize, quantize_params
from transformer.inference.runs import Run, open_run
from transformer.model.transformer import (
    Transformer,
    TransformerConfig,
    cache_can_grow,
    grow_cache,
    init_cache,
)
from transformer.util import progress

log = logging.getLogger("transformer")
BUCKET = 16  # source (and prompt) lengths are padded up to a multiple of this
DECODE_STAGE = 16  # a staged search's self-attention cache grows by this many positions
DROP_CHECK = 8  # beam search looks for decided sentences to drop every this many steps
# (`decode.drop_decided`: it compiles ~40 times the programs of one search per batch size, a
# minute more on a 2-core CPU, which the default's model there earns back after ~60,000
# sentences: docs/results/2026-12-06-decode-compiles.md)
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
    tokenizer: object  # transformer.data.tokenizer.Tokenizer (None: ids only, EOS ends)
    quantize: str = "none"  # "int8": int8 kernels (`quantize_params`) and KV cache

    def __post_init__(self):
        self.quantize = check_quantize(self.quantize)
        self.model = Transformer(self.model_config)
        ends = self.tokenizer.eos_ids if self.tokenizer is not None else ()
        self.stop_ids = tuple(i for i in ends if i != self.model_config.eos_id)
        # Host arrays go to the default device; jax.Arrays (e.g. sharded by training, over
        # several processes) stay where they are.
        self.params = jax.tree.map(
            lambda x: x if isinstance(x, jax.Array) else jax.device_put(x), self.params)
        if self.quantize == "int8":
            self.params = quantize_params(self.params)

    @property
    def max_source_length(self) -> int:
        """Longest source (in pieces, EOS included) the model's positions allow."""
        return self.model_config.max_len

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Piece ids + EOS per sentence, truncated to the model's max_len (one warning line
        for all: how many, which, and why)."""
        encoded = []
        cut = []
        for number, ids in enumerate(self.tokenizer.encode(sentences), 1):
            if len(ids) + 1 > self.max_source_length:
                cut.append(number)
                ids = ids[: self.max_source_length - 1]
            encoded.append(ids + [self.model_config.eos_id])
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
                  batch_size: int = 32, show_progress: bool = True,
                  drop_decided: bool | None = None) -> list[str]:
        """Translations of `sentences`, in order (beam_size 1 = greedy). Empty in, empty out.
        More than one batch shows progress on stderr (unless `show_progress` is False). The
        search settings left None are the config's `decode.*`."""
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
                                         alpha=alpha, max_extra_length=extra,
                                         drop_decided=drop_decided)
                for j, row in zip(chunk, ids, strict=True):
                    out[todo[j]] = self.tokenizer.decode(decoding.before_end(row,
                                                                             self.stop_ids))
                bar.update(len(chunk))
        return out

    def translate_ids(self, sources: list[list[int]], *, beam_size: int, alpha: float,
                      max_extra_length: int, drop_decided: bool | None = None) -> np.ndarray:
        """Best hypotheses [B, L] for source id lists (EOS included). Zeros after the end. The
        batch is padded to a power of two rows (copies of the first source, dropped after),
        so batches of any size compile a few programs per bucket, not one per size.
        `drop_decided` (None: the config's `decode.drop_decided`) runs beam search in parts
        that drop the sentences already decided (`_BeamSearchDroppingDecided`)."""
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
        if drop_decided is None:
            drop_decided = bool(self.config.decode.get("drop_decided", False))
        if drop_decided and beam_size > 1 and rows > 1 and _staged(self.model.config,
                                                                   max_length):
            search = _BeamSearchDroppingDecided(self.model, beam_size, float(alpha), max_length,
                                                self.stop_ids, self.quantize == "int8")
            return search(self.params, inputs, max_lengths)[:len(sources)]
        search = _search_fn(self.model, beam_size, float(alpha), max_length,
                            self.model_config.scan_layers, self.stop_ids,
                            self.quantize == "int8")
        return _to_host(search(self.params, inputs, max_lengths))[:len(sources)]


def _to_host(x: jax.Array) -> np.ndarray:
    """`x` as a numpy array, gathered from every process when the params are sharded over
    several (training's evaluation)."""
    if not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def _staged(config: TransformerConfig, max_length: int) -> bool:
    """Whether a search of `max_length` steps grows its cache in stages of DECODE_STAGE."""
    return cache_can_grow(config) and max_length >= MIN_STAGED_LENGTH


def _decode_fn(model: Transformer, params, encoded, inputs) -> decoding.DecodeFn:
    """A search's `decode_fn(tokens, cache)` over `encoded` [B, S, D] and `inputs` [B, S]: one
    row per sentence, which its beams share (their encoder keys and values). Int8 kernels are
    dequantized at each step."""

    def decode_fn(tokens, cache):
        return model.apply({"params": dequantize(params)}, encoded, inputs, tokens, cache=cache,
                           method="decode")

    return decode_fn


@functools.lru_cache(maxsize=32)
def _search_fn(model: Transformer, beam_size: int, alpha: float, max_length: int,
               scan_layers: bool, stop_ids: tuple[int, ...] = (), int8_cache: bool = False):
    """A jitted search `(params, inputs [B, S], max_lengths [B]) -> tokens [B, L]`, rows ending
    at EOS or an id of `stop_ids`; its KV cache int8 where `int8_cache`."""

    def search(params, inputs, max_lengths):
        batch = inputs.shape[0]
        encoded = model.apply({"params": dequantize(params)}, inputs, method="encode")

        decode_fn = _decode_fn(model, params, encoded, inputs)
        staged = {}
        if _staged(model.config, max_length):
            staged = {"cache_lengths": decoding.stage_lengths(max_length, DECODE_STAGE),
                      "grow_cache": functools.partial(grow_cache, model.config)}
        first_length = staged["cache_lengths"][0] if staged else max_length
        cache = init_cache(model.config, batch * beam_size, first_length, int8=int8_cache)
        bos = jnp.full((batch,), model.config.bos_id, jnp.int32)
        if beam_size == 1:
            return decoding.greedy_search(decode_fn, cache, bos=bos, max_lengths=max_lengths,
                                          max_length=max_length, eos_id=model.config.eos_id,
                                          stop_ids=stop_ids, **staged)
        seqs, _ = decoding.beam_search(decode_fn, cache, bos=bos, max_lengths=max_lengths,
                                       max_length=max_length, beam_size=beam_size,
                                       alpha=alpha, eos_id=model.config.eos_id,
                                       stop_ids=stop_ids, cache_batch_axis=1 if scan_layers else 0,
                                       **staged)
        return seqs[:, 0]

    return jax.jit(search)


@dataclasses.dataclass(frozen=True)
class _BeamSearchDroppingDecided:
    """Beam search run from the host in parts of DROP_CHECK steps (its cache grown by
    DECODE_STAGE positions) that drops the sentences already decided (as fairseq shrinks its
    batch): once the open sentences fit in fewer rows, only they (padded with copies to a
    power of two or 3/4 of one, `padded_rows`, so a few programs serve every size) go on.
    A step's cost is mostly per row (the output projection, the cache), and a batch's
    sentences decide at different steps. The best hypotheses are those of
    `decoding.beam_search` over the whole batch (up to float rounding: matrix products over
    fewer rows may round differently)."""

    model: Transformer
    beam_size: int
    alpha: float
    max_length: int
    stop_ids: tuple[int, ...] = ()  # ends besides EOS
    int8_cache: bool = False

    def __call__(self, params, inputs: np.ndarray, max_lengths: np.ndarray) -> np.ndarray:
        """Best hypotheses [B, T] of `inputs` [B, S] (B a power of two)."""
        lengths = decoding.stage_lengths(self.max_length, DECODE_STAGE)
        start, steps, grow, select = _dropping_fns(self.model, self.beam_size, self.alpha,
                                                   self.max_length, lengths[0], self.stop_ids,
                                                   self.int8_cache)
        state = start(params, inputs)
        best = np.zeros((inputs.shape[0], self.max_length), np.int32)
        rows = np.arange(inputs.shape[0])  # the sentence of `inputs` each row of `state` holds
        max_lengths = np.asarray(max_lengths)
        held = lengths[0]  # the cache's length
        for length, until in self._parts(lengths):
            if length > held:
                state, held = grow(state, length=length), length
            state, open_ = steps(params, state, max_lengths[rows], np.int32(until))
            keep = np.flatnonzero(_to_host(open_))
            if not len(keep):
                break
            size = padded_rows(len(keep))
            if size < len(rows):
                decided = np.setdiff1d(np.arange(len(rows)), keep)
                best[rows[decided]] = _best(state)[decided]
                keep = np.concatenate([keep, np.full(size - len(keep), keep[0])])
                state, rows = select(state, keep), rows[keep]
        best[rows] = _best(state)  # copies of a sentence hold the same hypothesis
        return best

    def _parts(self, lengths: tuple[int, ...]) -> list[tuple[int, int]]:
        """(cache length, step to run until) of each part: every DROP_CHECK steps, and at the
        end of each cache length (`decoding.stage_end`)."""
        parts = []
        done = 0
        for length in lengths:
            end = decoding.stage_end(length, self.max_length)
            untils = [*range(done - done % DROP_CHECK + DROP_CHECK, end, DROP_CHECK), end]
            parts += [(length, until) for until in untils]
            done = end
        return parts


def padded_rows(count: int) -> int:
    """The fewest rows that hold `count` sentences among the sizes a dropping search compiles
    for: powers of two and 3/4 of them (1, 2, 3, 4, 6, 8, 12, 16, 24, ...)."""
    power = 1 << (count - 1).bit_length()
    return power * 3 // 4 if power >= 4 and count <= power * 3 // 4 else power


def _best(state: dict) -> np.ndarray:
    """The best finished hypothesis [B', T] of each row of a `_dropping_fns` state."""
    return _to_host(state["search"]["finished_seqs"][:, 0])


@functools.lru_cache(maxsize=32)
def _dropping_fns(model: Transformer, beam_size: int, alpha: float, max_length: int,
                  first_length: int, stop_ids: tuple[int, ...] = (), int8_cache: bool = False):
    """The jitted parts of `_BeamSearchDroppingDecided`: `start(params, inputs)` encodes and
    takes the first step; `steps(params, state, max_lengths, until)` runs up to step `until`
    and says which sentences are open; `grow(state, length=)` lengthens the cache;
    `select(state, sentences)` keeps those rows."""
    axis = 1 if model.config.scan_layers else 0

    def decode_fn(params, state):
        return _decode_fn(model, params, state["encoded"], state["inputs"])

    def start(params, inputs):
        encoded = model.apply({"params": dequantize(params)}, inputs, method="encode")
        cache = init_cache(model.config, inputs.shape[0] * beam_size, first_length,
                           int8=int8_cache)
        state = {"encoded": encoded, "inputs": inputs}
        search = decoding.beam_search_start(
            decode_fn(params, state), cache,
            bos=jnp.full((inputs.shape[0],), model.config.bos_id, jnp.int32),
            beam_size=beam_size, max_length=max_length)
        return {**state, "search": search}

    def steps(params, state, max_lengths, until):
        search = decoding.beam_search_steps(
            decode_fn(params, state), state["search"], until=until, max_lengths=max_lengths,
            max_length=max_length, beam_size=beam_size, alpha=alpha, eos_id=model.config.eos_id,
            stop_ids=stop_ids, cache_batch_axis=axis)
        open_ = decoding.beam_search_open(search, max_lengths=max_lengths, alpha=alpha)
        return {**state, "search": search}, open_

    def grow(state, length):
        search = state["search"]
        cache = grow_cache(model.config, search["cache"], length)
        return {**state, "search": {**search, "cache": cache}}

    def select(state, sentences):
        search = decoding.select_sentences(state["search"], sentences, beam_size=beam_size,
                                           cache_batch_axis=axis)
        return {"encoded": state["encoded"][sentences], "inputs": state["inputs"][sentences],
                "search": search}

    return (jax.jit(start), jax.jit(steps, donate_argnums=1),
            jax.jit(grow, static_argnames="length"), jax.jit(select))


def load(workdir: str, *, step: int | None = None, average: int | None = None,
         quantize: str = "none") -> Translator:
    """The translator of a trained workdir: checkpoint `step`, the latest, or the average of
    the last `average` (`runs.open_run`), int8 where `quantize="int8"`."""
    check_quantize(quantize)  # before anything is read
    run = open_run(workdir, step=step, average=average,
                   check=lambda model: require_translation(workdir, model))
    return from_run(run, quantize=quantize)


def from_run(run: Run, *, quantize: str = "none") -> Translator:
    """The translator of an opened run. One line unless it is a translation model."""
    require_translation(run.workdir, run.model)
    return Translator(run.config, run.model, run.params, run.tokenizer, quantize)


def require_translation(workdir: str, model: TransformerConfig) -> None:
    """One line unless `model` translates: an encoder-decoder."""
    if model.architecture != "encoder_decoder":
        raise ValueError(f"{workdir} holds a language model (model.architecture="
                         f"{model.architecture!r}), not a translation model: continue text "
                         f"with python -m transformer.generate; its perplexity is in "
                         f"metrics.jsonl")
