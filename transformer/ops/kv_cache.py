"""The KV cache's arithmetic, as pure functions: where a decoding step's keys and values go.

A layer's self-attention cache is {"key": [B, K, S, H], "value": [B, K, S, Hv]} (heads first, as
`attention.cache_attention` reads it), written at a step's positions by `write_cache`. A local
layer keeps a ring buffer of its last w positions (`write_ring`). A linear layer's recurrent
state is `linear_attention.decode_step`'s. The searches that drive the cache are
`transformer.inference.decoding`. Legend: `transformer/__init__.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def heads_first(x: jax.Array) -> jax.Array:
    """[B, T, K, H] keys or values as a cache holds them: [B, K, T, H]."""
    return jnp.swapaxes(x, 1, 2)


def write_cache(cache: dict, key: jax.Array, value: jax.Array, index: jax.Array | int) -> dict:
    """A layer's self-attention cache {"key": [B, K, S, H], "value": [B, K, S, Hv]} (heads first,
    as `attention.cache_attention` reads it) with the new key [B, T, K, H] and value
    [B, T, K, Hv] written at positions index..index+T-1, in the cache's dtype."""
    start = (0, 0, index, 0)
    return {name: jax.lax.dynamic_update_slice(
        cache[name], heads_first(new).astype(cache[name].dtype), start)
        for name, new in (("key", key), ("value", value))}


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
