"""The KV cache's arithmetic, as pure functions: where a decoding step's keys and values go.

A layer's self-attention cache is {"key": [B, K, S, H], "value": [B, K, S, Hv]} (heads first, as
`attention.cache_attention` reads it), written at a step's positions by `write_cache`. A local
layer keeps a ring buffer of its last w positions (`write_ring`). A linear layer's recurrent
state is `linear_attention.decode_step`'s. The searches that drive the cache are
`transformer.inference.decoding`. Legend: `transformer/__init__.py`.

An int8 cache (`init_cache(..., int8=True)`, decoding with `quantize="int8"`) holds the keys and
values as int8 with a float32 scale per (row, head, position), "key_scale" [B, K, S, 1] and
"value_scale" [B, K, S, 1] beside them: symmetric absmax quantization over each vector's H
values (`quantize_int8`, Qwix's int8 scheme), read back in the compute dtype (`read`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def heads_first(x: jax.Array) -> jax.Array:
    """[B, T, K, H] keys or values as a cache holds them: [B, K, T, H]."""
    return jnp.swapaxes(x, 1, 2)


INT8_BOUND = 127.5  # |x| / scale <= 127.5 rounds into [-128, 127] (saturating at 127.5)


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(q int8, scale float32 [..., 1]) with x ~ q * scale over the last axis: scale =
    max|x| / 127.5 (1 where that is below sqrt(float32 tiny)), q = round(x / scale) saturated
    to int8, so |x - q * scale| <= scale / 2. The scheme of `qwix.quantize(x, jnp.int8,
    channelwise_axes=<all but the last>)`, written out so that the model needs no Qwix."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / INT8_BOUND
    scale = jnp.where(scale < jnp.sqrt(jnp.finfo(jnp.float32).tiny), 1.0, scale)
    q = jnp.clip(jnp.round(x / scale), -128, 127).astype(jnp.int8)
    return q, scale


def store(cache: dict, key: jax.Array, value: jax.Array) -> dict:
    """A cache entry holding key [.., H] and value [.., Hv] whole (a cross-attention's encoder
    keys and values, heads first): int8 with their scales where `cache` has "key_scale" (an
    int8 cache's empty entry), else as they are."""
    if "key_scale" not in cache:
        return {"key": key, "value": value}
    (key, key_scale), (value, value_scale) = quantize_int8(key), quantize_int8(value)
    return {"key": key, "value": value, "key_scale": key_scale, "value_scale": value_scale}


def read(cache: dict, dtype) -> tuple[jax.Array, jax.Array]:
    """A cache entry's keys and values in `dtype`: an int8 entry's dequantized (q * scale)."""
    if "key_scale" not in cache:
        return cache["key"], cache["value"]
    return tuple((cache[name].astype(jnp.float32) * cache[f"{name}_scale"]).astype(dtype)
                 for name in ("key", "value"))


def write_cache(cache: dict, key: jax.Array, value: jax.Array, index: jax.Array | int) -> dict:
    """A layer's self-attention cache {"key": [B, K, S, H], "value": [B, K, S, Hv]} (heads first,
    as `attention.cache_attention` reads it) with the new key [B, T, K, H] and value
    [B, T, K, Hv] written at positions index..index+T-1, in the cache's dtype (an int8
    cache's quantized, their scales written beside them)."""
    start = (0, 0, index, 0)
    new = {"key": heads_first(key), "value": heads_first(value)}
    if "key_scale" in cache:
        for name in ("key", "value"):
            new[name], new[f"{name}_scale"] = quantize_int8(new[name])
    return {name: jax.lax.dynamic_update_slice(cache[name], x.astype(cache[name].dtype), start)
            for name, x in new.items()}


def write_ring(cache: dict, key: jax.Array, value: jax.Array, positions: jax.Array) -> dict:
    """A local layer's ring buffer {"key": [B, K, C, H], "value": [B, K, C, Hv], "position":
    [B, C]} (slot i holds the newest position p kept with p % C == i; -1 = empty) with the new
    key [B, T, K, H] and value [B, T, K, Hv] at `positions` [B, T] (-1: not kept, e.g. the
    padding after a prompt): each slot takes the newest new token that maps to it. With C = w,
    the slots hold the w positions before the next query, all its window needs."""
    c = cache["position"].shape[1]
    t = positions.shape[1]
    hit = (positions[:, :, None] >= 0) & (positions[:, :, None] % c == jnp.arange(c))  # [B,T,C]
    newest = t - 1 - jnp.argmax(hit[:, ::-1], axis=1)  # [B, C]
    taken = hit.any(axis=1)

    def put(old, new):  # along the slots axis: 1 of [B, C], 2 of [B, K, C, H]
        if old.ndim == 2:
            return jnp.where(taken, jnp.take_along_axis(new, newest, axis=1), old)
        new = jnp.take_along_axis(heads_first(new), newest[:, None, :, None], axis=2)
        return jnp.where(taken[:, None, :, None], new.astype(old.dtype), old)

    return {"key": put(cache["key"], key), "value": put(cache["value"], value),
            "position": put(cache["position"], positions)}
