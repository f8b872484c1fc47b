"""The Python API for language models beside the CLI: load a trained decoder-only workdir and
continue prompts.

    import transformer
    generator = transformer.load_generator("runs/lm_default")
    generator.generate(["Click the"], max_new_tokens=20, temperature=0.8, top_p=0.95, seed=0)

A prompt is encoded with the run's vocabulary, read after the tokens the vocabulary puts before
a text (`prompt_start`: BOS, or nothing where an imported `tokenizer.json`'s post-processor adds
none, as `transformers` reads it) in one decoder call that fills the KV cache (a prefix LM reads
it in both directions, as in training), then tokens are drawn one at a time
(`decoding.sample`) until EOS or `max_new_tokens`. An imported checkpoint's vocabulary may
list further ends (`eos_ids`: those of its generation_config.json, as `transformers`' `generate`
stops at each): a row stops at the first of any, on the device (no host round trip per token),
and its text ends before it. `quantize="int8"` generates with int8 attention and feed-forward
kernels and an int8 KV cache (`inference/quantize.py`).

Prompts are padded at the end into length buckets (`translator.bucket_length`, as translation
sources) and batches to a power of two rows, so a stream of prompts compiles one program per
(bucket, rows), not one per prompt length. Padding changes no result: the pad positions come
after the prompt (no prompt position sees them), and each row's cache index restarts at its own
prompt length, so its first new token overwrites the first pad, with that position, and a
position never attends to a pad. Each prompt has its own key (`fold_in(key(seed), prompt
index)`), so its continuation does not depend on the other prompts of its batch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from transformer.inference import decoding
from transformer.inference.quantize import check_quantize, dequantize, quantize_params
from transformer.inference.runs import open_run
from transformer.inference.translator import bucket_length
from transformer.model.transformer import Transformer, TransformerConfig, init_cache
from transformer.util import progress

log = logging.getLogger("transformer")
PROBE = "a"  # a text whose encodings, with and without special tokens, show the prompt start


@dataclasses.dataclass
class Generator:
    """A trained decoder-only model, its parameters and its tokenizer."""

    config: ConfigDict  # a `Resolved.config`: generate.* and data.objective
    model_config: TransformerConfig
    params: dict
    tokenizer: object  # transformer.data.tokenizer.Tokenizer
    quantize: str = "none"  # "int8": int8 kernels (`quantize_params`) and KV cache

    def __post_init__(self):
        self.quantize = check_quantize(self.quantize)
        _require_decoder(self.model_config.architecture)
        self.start = prompt_start(self.tokenizer, self.model_config.bos_id)
        self.eos_ids = (tuple(self.tokenizer.eos_ids) if self.tokenizer is not None
                        else (self.model_config.eos_id,))  # token ids without a vocabulary
        self.model = Transformer(self.model_config)
        self.prefix_lm = self.config.data.get("objective") == "prefix"
        self.params = jax.tree.map(
            lambda x: x if isinstance(x, jax.Array) else jax.device_put(x), self.params)
        if self.quantize == "int8":
            self.params = quantize_params(self.params)

    def encode(self, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
        """Piece ids per prompt, keeping (with a warning) the last pieces that leave room for
        the prompt's start (`prompt_start`) and `max_new_tokens` within the model's max_len."""
        room = self.model_config.max_len - len(self.start) - max_new_tokens
        if room < 0 and self.model_config.positional in ("sinusoidal", "learned"):
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt "
                             f"within model.max_len={self.model_config.max_len}")
        encoded = []
        cut = []
        for number, ids in enumerate(self.tokenizer.encode(prompts), 1):
            if self.model_config.positional in ("sinusoidal", "learned") and len(ids) > room:
                cut.append(number)
                ids = ids[len(ids) - room:]
            encoded.append(ids)
        if cut:
            shown = ", ".join(map(str, cut[:5])) + (", ..." if len(cut) > 5 else "")
            log.warning("%d of %d prompts are longer than the %d pieces that leave room for "
                        "max_new_tokens=%d within model.max_len=%d: kept their last %d pieces "
                        "(prompt %s)", len(cut), len(prompts), room, max_new_tokens,
                        self.model_config.max_len, room, shown)
        return encoded

    def generate(self, prompts: list[str], *, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, batch_size: int = 32,
                 first_index: int = 0, show_progress: bool = True) -> list[str]:
        """Each prompt followed by its continuation, in order. Unset options come from the
        config's `generate.*`. Temperature 0 is greedy. Prompt i draws with the key of index
        `first_index + i` (a stream passes its position, so its chunks give what one call
        gives). Progress on stderr for more than one batch unless `show_progress` is False."""
        defaults = self.config.get("generate") or ConfigDict(dict(
            max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0))
        options = dict(
            max_new_tokens=int(defaults.max_new_tokens if max_new_tokens is None
                               else max_new_tokens),
            temperature=float(defaults.temperature if temperature is None else temperature),
            top_k=int(defaults.top_k if top_k is None else top_k),
            top_p=float(defaults.top_p if top_p is None else top_p))
        _check_options(**options)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        encoded = self.encode(prompts, options["max_new_tokens"])
        by_bucket: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            length = self.bucket(len(ids), options["max_new_tokens"])
            by_bucket.setdefault(length, []).append(i)
        out = [""] * len(prompts)
        with progress.bar(len(prompts), "generating", unit="prompt",
                          show=show_progress and len(prompts) > batch_size) as bar:
            for length, members in sorted(by_bucket.items()):
                for start in range(0, len(members), batch_size):
                    chunk = members[start:start + batch_size]
                    tokens = self.generate_ids([encoded[i] for i in chunk],
                                               prompt_indices=[first_index + i for i in chunk],
                                               seed=seed, length=length,
                                               rows=min(_power_of_two(len(chunk)), batch_size),
                                               **options)
                    for i, row in zip(chunk, tokens, strict=True):
                        out[i] = self.tokenizer.decode(encoded[i] + decoding.before_end(
                            row, self.eos_ids))
                    bar.update(len(chunk))
        return out

    def bucket(self, prompt_length: int, max_new_tokens: int) -> int:
        """The padded length of the decoder's prompt input (`prompt_start` and `prompt_length`
        pieces): a multiple of `translator.BUCKET`, capped where the prompt and `max_new_tokens`
        fill model.max_len."""
        return bucket_length(len(self.start) + prompt_length,
                             self.model_config.max_len - max_new_tokens)

    def generate_ids(self, prompts: list[list[int]], *, prompt_indices: list[int], seed: int,
                     max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                     length: int | None = None, rows: int | None = None) -> np.ndarray:
        """New tokens [len(prompts), max_new_tokens] after prompts (piece ids, any lengths).
        Zeros after a row's end (its first id of `eos_ids`). Prompt `prompt_indices[i]` draws
        with `fold_in(key(seed), index)`.

        The prompts are read after `prompt_start`, padded to `length` (default: the bucket of
        the longest), and the batch to `rows` (default: the next power of two) with copies of
        the first prompt. Neither changes any prompt's tokens.
        """
        start = list(self.start)
        if not start and not all(prompts):
            raise ValueError("an empty prompt with a vocabulary that puts no BOS before a text "
                             "(its tokenizer.json's post-processor): give every prompt a token")
        longest = len(start) + max(len(ids) for ids in prompts)
        length = (self.bucket(longest - len(start), max_new_tokens) if length is None
                  else length)
        rows = _power_of_two(len(prompts)) if rows is None else rows
        if length < longest or rows < len(prompts):
            raise ValueError(f"cannot pad {len(prompts)} prompts of up to {longest} decoder "
                             f"inputs to {rows} rows of {length}")
        # Rows beyond the prompts repeat the first (input, length and key): they finish with
        # it, so they never lengthen the loop; their tokens are dropped.
        order = list(range(len(prompts))) + [0] * (rows - len(prompts))
        inputs = np.zeros((rows, length), np.int32)
        for row, i in enumerate(order):
            inputs[row, :len(start) + len(prompts[i])] = start + prompts[i]
        lengths = np.array([len(start) + len(prompts[i]) for i in order], np.int32)
        indices = np.asarray(prompt_indices, np.uint32)[order]
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
            jax.random.key(seed), jnp.asarray(indices))
        stops = tuple(i for i in self.eos_ids if i != self.model_config.eos_id)
        run = _sample_fn(self.model, self.prefix_lm, max_new_tokens, temperature, top_k, top_p,
                         stops, self.quantize == "int8")
        return np.asarray(run(self.params, inputs, lengths, keys))[:len(prompts)]


def prompt_start(tokenizer, bos_id: int) -> tuple[int, ...]:
    """The ids a prompt is read after: those the post-processor of an imported `tokenizer.json`
    (its template) puts before a text, as `transformers`' tokenizers add them (Llama 3's BOS;
    nothing for GPT-2's or Qwen2's); `(bos_id,)` for a SentencePiece vocabulary (ours, whose runs
    train behind BOS, and Llama 2's, whose `transformers` tokenizer adds BOS) and for token ids
    without a vocabulary."""
    json_bytes = getattr(tokenizer, "json_bytes", None)
    if json_bytes is None:
        return (bos_id,)
    from tokenizers import Tokenizer

    model = Tokenizer.from_str(json_bytes.decode("utf-8"))
    plain = model.encode(PROBE, add_special_tokens=False).ids
    special = model.encode(PROBE, add_special_tokens=True).ids
    starts = [i for i in range(len(special) - len(plain) + 1)
              if special[i:i + len(plain)] == plain]
    return tuple(special[:starts[0]]) if starts else (bos_id,)


def _require_decoder(architecture: str) -> None:
    if architecture != "decoder":
        raise ValueError(f"generation needs a decoder-only model; this run's model.architecture "
                         f"is {architecture!r} (translation: python -m transformer.translate)")


def _check_options(*, max_new_tokens, temperature, top_k, top_p) -> None:
    for name, value, ok, want in (("max_new_tokens", max_new_tokens, max_new_tokens >= 1, ">= 1"),
                                  ("temperature", temperature, temperature >= 0.0, ">= 0"),
                                  ("top_k", top_k, top_k >= 0, ">= 0 (0: all tokens)"),
                                  ("top_p", top_p, 0.0 < top_p <= 1.0, "in (0, 1]")):
        if not ok:
            raise ValueError(f"{name}={value} must be {want}")


def _power_of_two(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


def _map_layers(fn, cache: dict) -> dict:
    """`fn` applied to every array of a decoding cache but its index."""
    return {name: value if name == "index" else jax.tree.map(fn, value)
            for name, value in cache.items()}


@functools.lru_cache(maxsize=32)
def _sample_fn(model: Transformer, prefix_lm: bool, max_new_tokens: int, temperature: float,
               top_k: int, top_p: float, stop_ids: tuple[int, ...], int8_cache: bool = False):
    """A jitted `(params, inputs [B, P], lengths [B], keys [B]) -> tokens [B, max_new_tokens]`:
    row b's decoder input is `inputs[b, :lengths[b]]` (its start and prompt), then padding. A
    row ends at EOS or an id of `stop_ids`. The KV cache is int8 where `int8_cache`; int8
    kernels are dequantized at each call of the model."""
    batch_axis = 1 if model.config.scan_layers else 0  # of the cache's layer leaves

    def run(params, inputs, lengths, keys):
        batch, length = inputs.shape
        # The prompts in one call; a prompt position sees no padding (it comes after them).
        cache = init_cache(model.config, batch, length + max_new_tokens, int8=int8_cache)
        prompt = jnp.arange(length)[None, :] < lengths[:, None]  # the rest is padding
        logits, cache = model.apply({"params": dequantize(params)}, None, None, inputs,
                                    cache=cache,
                                    targets_prefix=prompt if prefix_lm else None,
                                    targets_segmentation=prompt, method="decode")
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)
        # Each row goes on from its own length: the cache index becomes one per row, and each
        # step is the model on one row (batch 1, a scalar index), vmapped over the rows.
        cache = {**cache, "index": lengths}
        axes = {name: 0 if name == "index" else batch_axis for name in cache}

        def decode_row(token, row_cache):
            logits, row_cache = model.apply(  # a new token is kept, id 0 included
                {"params": dequantize(params)}, None, None, token[None],
                cache=_map_layers(lambda x: jnp.expand_dims(x, batch_axis), row_cache),
                targets_segmentation=jnp.ones((1, 1), bool), method="decode")
            return logits[0], _map_layers(lambda x: jnp.squeeze(x, batch_axis), row_cache)

        decode_fn = jax.vmap(decode_row, in_axes=(0, axes), out_axes=(0, axes))
        return decoding.sample(decode_fn, cache, last, keys=keys, max_length=max_new_tokens,
                               eos_id=model.config.eos_id, temperature=temperature,
                               top_k=top_k, top_p=top_p, pad_id=model.config.pad_id,
                               stop_ids=stop_ids)

    return jax.jit(run)


def load_generator(workdir: str, *, step: int | None = None,
                   quantize: str = "none") -> Generator:
    """The generator of a trained decoder-only workdir, at checkpoint `step` or the latest
    (`runs.open_run`), int8 where `quantize="int8"`."""
    check_quantize(quantize)  # before anything is read
    run = open_run(workdir, step=step, check=lambda model: _require_decoder(model.architecture))
    return Generator(run.config, run.model, run.params, run.tokenizer, quantize)
