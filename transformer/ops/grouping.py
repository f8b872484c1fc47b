"""Grouped-query views shared by the attention kernels (legend: `transformer/__init__.py`).

Query head n uses kv head n // G (G = N / K), so q [B, T, N, H] is viewed as [B, T, K, G, H] and
a mask or bias broadcastable to [B, N, T, S] as one broadcastable to [B, K, G, T, S].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float(jnp.finfo(jnp.float32).min)  # the logit of a masked key (float32 softmax)


def group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, T, N, H] -> [B, T, K, G, H]. Query head n uses kv head n // G."""
    b, t, n, h = q.shape
    if n % num_kv_heads:
        raise ValueError(f"query heads N={n} must be a multiple of kv heads K={num_kv_heads}")
    return q.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def as_5d(x: jax.Array | None, num_kv_heads: int) -> jax.Array | None:
    """A mask or bias broadcastable to [B, N, T, S] -> broadcastable to [B, K, G, T, S]."""
    if x is None:
        return None
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, n, t, s = x.shape
    if n == 1:
        return x[:, :, None]
    return x.reshape(b, num_kv_heads, n // num_kv_heads, t, s)
