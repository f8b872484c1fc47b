"""Attention masks, as pure functions of arrays: boolean, True = attend, broadcastable to
[B, N, T, S] (shapes in the legend of `transformer/__init__.py`).

The paper's masks (causal, padding) and those of packed rows, prefix LMs and incremental
decoding. The sparse patterns of efficient attention: a sliding window (`make_local_mask`,
what `local_window_size` applies), Longformer's global tokens (`make_global_mask`, and the
`global_tokens` first positions of a row beside a window). `transformer.ops.attention` re-exports
every name here (the research API, docs/research-api.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def make_causal_mask(length: int) -> jax.Array:
    """[1, 1, T, T]: query t attends to keys s <= t."""
    return jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))[None, None]


def make_padding_mask(q_valid: jax.Array, kv_valid: jax.Array) -> jax.Array:
    """[B, 1, T, S] from q_valid [B, T] and kv_valid [B, S] (True or nonzero = real token)."""
    q_valid, kv_valid = q_valid.astype(jnp.bool_), kv_valid.astype(jnp.bool_)
    return (q_valid[:, None, :, None] & kv_valid[:, None, None, :])


def make_segment_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array) -> jax.Array:
    """[B, 1, T, S] for packed rows: attend within the same segment. Segment id 0 is padding."""
    same = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
    return same & make_padding_mask(q_segment_ids, kv_segment_ids)


def make_prefix_lm_mask(in_prefix: jax.Array) -> jax.Array:
    """[B, 1, T, T] for a prefix LM: causal, except that positions of the prefix (in_prefix
    [B, T], True or nonzero) attend to each other in both directions."""
    in_prefix = in_prefix.astype(jnp.bool_)
    both = in_prefix[:, None, :, None] & in_prefix[:, None, None, :]
    return make_causal_mask(in_prefix.shape[1]) | both


def make_decoder_mask(segment_ids: jax.Array, in_prefix: jax.Array | None = None) -> jax.Array:
    """[B, 1, T, T], a decoder's self-attention over a whole row (training): causal, or a
    prefix LM's mask (`make_prefix_lm_mask(in_prefix)`), within each segment.

    segment_ids [B, T]: the packed segments, id 0 = padding (a row of one sequence passes
    `tokens != 0`).
    """
    causal = (make_causal_mask(segment_ids.shape[1]) if in_prefix is None
              else make_prefix_lm_mask(in_prefix))
    return combine_masks(causal, make_segment_mask(segment_ids, segment_ids))


def make_cache_mask(index: jax.Array | int, query_length: int, cache_length: int,
                    in_prefix: jax.Array | None = None) -> jax.Array:
    """[1, 1, T, S] ([B, 1, T, S] with `in_prefix`), incremental decoding's self-attention:
    the T new queries at positions index..index+T-1 attend to the S cache positions up to
    their own.

    in_prefix [B, T] (True or nonzero): the new tokens that form a prefix LM's prefix, which
    attend to each other in both directions (the whole prefix comes in one call).
    """
    positions = index + jnp.arange(query_length)
    mask = (jnp.arange(cache_length)[None, :] <= positions[:, None])[None, None]
    if in_prefix is None:
        return mask
    in_prefix = in_prefix.astype(jnp.bool_)
    key_in_prefix = jax.lax.dynamic_update_slice(
        jnp.zeros((in_prefix.shape[0], cache_length), jnp.bool_), in_prefix, (0, index))
    return mask | (in_prefix[:, None, :, None] & key_in_prefix[:, None, None, :])


def window_sizes(local_window_size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """(left, right) from w (= (w, w)) or a pair, as `jax.nn.dot_product_attention` reads it."""
    if local_window_size is None:
        return None
    left, right = ((local_window_size, local_window_size) if isinstance(local_window_size, int)
                   else tuple(local_window_size))
    if min(left, right) < 0:
        raise ValueError(f"local_window_size={local_window_size} must be >= 0 on both sides")
    return int(left), int(right)


def make_local_mask(q_positions: jax.Array, kv_positions: jax.Array,
                    local_window_size: int | tuple[int, int], global_tokens: int = 0) -> jax.Array:
    """[1, 1, T, S] ([B, 1, T, S] from [B, T] / [B, S] positions): a query at position t attends
    the keys at positions t - left .. t + right (a sliding window; causal: (w, 0)), and the
    positions below `global_tokens` attend to and from every position (Longformer's global
    tokens, here the first positions of a row).

    q_positions [T] or [B, T], kv_positions [S] or [B, S]; `make_local_mask(jnp.arange(T),
    jnp.arange(S), w, g)` is what `local_window_size=w, global_tokens=g` applies.
    """
    left, right = window_sizes(local_window_size)
    offset = kv_positions[..., None, :] - q_positions[..., :, None]  # [..., T, S]
    mask = (offset >= -left) & (offset <= right)
    if global_tokens:
        mask = (mask | (q_positions[..., :, None] < global_tokens)
                | (kv_positions[..., None, :] < global_tokens))
    return mask[None, None] if mask.ndim == 2 else mask[:, None]


def make_global_mask(is_global: jax.Array) -> jax.Array:
    """[B, 1, S, S] for self-attention with global tokens (Longformer): a global token (is_global
    [B, S], True or nonzero) attends to every position and every position attends to it.
    Global tokens widen a sparse pattern: `combine_masks(mask, make_local_mask(..) |
    make_global_mask(g))`."""
    is_global = is_global.astype(jnp.bool_)
    return is_global[:, None, :, None] | is_global[:, None, None, :]


def make_window_cache_mask(index: jax.Array | int, query_length: int, kv_positions: jax.Array,
                           local_window_size: int | tuple[int, int],
                           in_prefix: jax.Array | None = None,
                           global_tokens: int = 0) -> jax.Array:
    """[B, 1, T, S], incremental decoding's self-attention for a local layer: the T new queries
    at positions index..index+T-1 attend the S keys at `kv_positions` [B, S] (a ring buffer's
    slots, then the T new tokens; -1 = empty or not kept) that are within their window and not
    after them. in_prefix [B, T]: the new tokens that form a prefix LM's prefix, which also
    attend to the later ones within the window (the whole prefix comes in one call).
    global_tokens: the positions below it are attended from every query (`make_local_mask`)."""
    q_positions = index + jnp.arange(query_length)
    mask = make_local_mask(q_positions, kv_positions, local_window_size, global_tokens)
    earlier = kv_positions[:, None, None, :] <= q_positions[:, None]
    if in_prefix is not None:
        in_prefix = in_prefix.astype(jnp.bool_)
        key_in_prefix = jnp.pad(in_prefix, ((0, 0), (kv_positions.shape[1] - query_length, 0)))
        earlier = earlier | (in_prefix[:, None, :, None] & key_in_prefix[:, None, None, :])
    return mask & earlier & (kv_positions >= 0)[:, None, None, :]


def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
    """Logical and of the masks that are not None (None if all are)."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    return functools.reduce(jnp.logical_and, masks)
