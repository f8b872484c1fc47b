"""The Python API for language models beside the CLI: load a trained decoder-only workdir and
continue prompts.

    from transformer.generator import load_generator
    generator = load_generator("runs/lm_default")
    generator.generate(["Click the"], max_new_tokens=20, temperature=0.8, top_p=0.95, seed=0)

A prompt is SentencePiece-encoded with the run's vocabulary, read after BOS in one decoder call
that fills the KV cache (a prefix LM reads it in both directions, as in training), then tokens
are drawn one at a time (`decoding.sample`) until EOS or `max_new_tokens`. Prompts of the same
length in pieces share a batch; each prompt has its own key (`fold_in(key(seed), prompt
index)`), so its continuation does not depend on the other prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from transformer import checkpoint, decoding
from transformer.model import BOS_ID, Transformer, TransformerConfig, init_cache
from transformer.translator import load_config, load_tokenizer

log = logging.getLogger("transformer")
EOS_ID = 3


@dataclasses.dataclass
class Generator:
    """A trained decoder-only model, its parameters and its tokenizer."""

    config: ConfigDict
    params: dict
    tokenizer: object  # transformer.data.tokenizer.Tokenizer

    def __post_init__(self):
        self.model_config = TransformerConfig.from_dict(self.config.model)
        _require_decoder(self.model_config.architecture)
        self.model = Transformer(self.model_config)
        self.prefix_lm = self.config.data.get("objective") == "prefix"
        self.params = jax.tree.map(
            lambda x: x if isinstance(x, jax.Array) else jax.device_put(x), self.params)

    def encode(self, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
        """Piece ids per prompt, keeping (with a warning) the last pieces that leave room for
        BOS and `max_new_tokens` within the model's max_len."""
        room = self.model_config.max_len - 1 - max_new_tokens
        if room < 0 and self.model_config.positional in ("sinusoidal", "learned"):
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt "
                             f"within model.max_len={self.model_config.max_len}")
        encoded = []
        for number, ids in enumerate(self.tokenizer.encode(prompts), 1):
            if self.model_config.positional in ("sinusoidal", "learned") and len(ids) > room:
                log.warning("prompt %d has %d pieces; keeping its last %d", number, len(ids),
                            room)
                ids = ids[len(ids) - room:]
            encoded.append(ids)
        return encoded

    def generate(self, prompts: list[str], *, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, batch_size: int = 32) -> list[str]:
        """Each prompt followed by its continuation, in order. Unset options come from the
        config's `generate.*`; temperature 0 is greedy."""
        defaults = self.config.get("generate") or ConfigDict(dict(
            max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0))
        options = dict(
            max_new_tokens=int(defaults.max_new_tokens if max_new_tokens is None
                               else max_new_tokens),
            temperature=float(defaults.temperature if temperature is None else temperature),
            top_k=int(defaults.top_k if top_k is None else top_k),
            top_p=float(defaults.top_p if top_p is None else top_p))
        _check_options(**options)
        encoded = self.encode(prompts, options["max_new_tokens"])
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            by_length.setdefault(len(ids), []).append(i)
        out = [""] * len(prompts)
        for _, members in sorted(by_length.items()):
            for start in range(0, len(members), batch_size):
                chunk = members[start:start + batch_size]
                tokens = self.generate_ids([encoded[i] for i in chunk], prompt_indices=chunk,
                                           seed=seed, **options)
                for i, row in zip(chunk, tokens, strict=True):
                    out[i] = self.tokenizer.decode(encoded[i] + row.tolist())
        return out

    def generate_ids(self, prompts: list[list[int]], *, prompt_indices: list[int], seed: int,
                     max_new_tokens: int, temperature: float, top_k: int,
                     top_p: float) -> np.ndarray:
        """New tokens [B, max_new_tokens] after prompts of one length; zeros after EOS."""
        inputs = np.array([[BOS_ID] + ids for ids in prompts], np.int32)
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
            jax.random.key(seed), jnp.asarray(prompt_indices, jnp.uint32))
        run = _sample_fn(self.model, self.prefix_lm, max_new_tokens, temperature, top_k, top_p)
        return np.asarray(run(self.params, inputs, keys))


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


@functools.lru_cache(maxsize=32)
def _sample_fn(model: Transformer, prefix_lm: bool, max_new_tokens: int, temperature: float,
               top_k: int, top_p: float):
    """A jitted `(params, inputs [B, 1 + P], keys [B]) -> tokens [B, max_new_tokens]`."""

    def run(params, inputs, keys):
        batch, length = inputs.shape

        def decode_fn(tokens, cache, **kwargs):
            return model.apply({"params": params}, None, None, tokens, cache=cache,
                               method="decode", **kwargs)

        cache = init_cache(model.config, batch, length + max_new_tokens)
        prefix = jnp.ones_like(inputs) if prefix_lm else None
        logits, cache = decode_fn(inputs, cache, targets_prefix=prefix)
        return decoding.sample(decode_fn, cache, logits[:, -1:], keys=keys,
                               max_length=max_new_tokens, eos_id=EOS_ID,
                               temperature=temperature, top_k=top_k, top_p=top_p)

    return jax.jit(run)


def load_generator(workdir: str, *, step: int | None = None) -> Generator:
    """Config, parameters (checkpoint `step` or the latest) and tokenizer of a trained
    decoder-only workdir."""
    config = load_config(workdir)
    _require_decoder(config.model.architecture)
    tokenizer = load_tokenizer(workdir, config)
    return Generator(config, checkpoint.load_params(workdir, step=step), tokenizer)
