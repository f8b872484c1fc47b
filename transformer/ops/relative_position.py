"""T5's relative position bias (Raffel et al., 2020, section 2.1), as pure functions of arrays.

Each head adds a learned scalar to the logit of query position i and key position j, read from
a table [num_buckets, N] at the bucket of the relative position j - i: a bucket for each of
the small distances, then buckets that grow logarithmically up to `max_distance`, beyond which
every distance shares the last bucket. Bidirectional (an encoder) gives half the buckets to keys
after the query. Unidirectional (a causal decoder) maps every key after the query to bucket 0.
The formula is mesh-tensorflow's and `transformers`' T5 (`_relative_position_bucket`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def relative_position_bucket(relative_position: jax.Array, *, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> jax.Array:
    """Bucket ids (int32, in 0..num_buckets-1) of `relative_position` = key - query (int)."""
    relative_position = jnp.asarray(relative_position, jnp.int32)
    buckets = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = jnp.where(relative_position > 0, num_buckets, 0)
        distance = jnp.abs(relative_position)
    else:
        distance = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    far = jnp.maximum(distance, max_exact)  # the small distances are not read from it
    scaled = (jnp.log(far.astype(jnp.float32) / max_exact)  # float32, as T5 computes it
              / jnp.float32(math.log(max_distance / max_exact))
              * jnp.float32(num_buckets - max_exact))
    large = jnp.minimum(max_exact + scaled.astype(jnp.int32), num_buckets - 1)
    return buckets + jnp.where(distance < max_exact, distance, large)


def relative_position_bias(table: jax.Array, q_positions: jax.Array, k_positions: jax.Array, *,
                           bidirectional: bool, max_distance: int) -> jax.Array:
    """The logits' bias [B, N, T, S] float32 from `table` [num_buckets, N] for queries at
    `q_positions` [B, T] and keys at `k_positions` [B or 1, S]."""
    relative = k_positions[:, None, :] - q_positions[:, :, None]  # [B, T, S]
    buckets = relative_position_bucket(relative, bidirectional=bidirectional,
                                       num_buckets=table.shape[0], max_distance=max_distance)
    return jnp.moveaxis(jnp.asarray(table, jnp.float32)[buckets], -1, 1)
