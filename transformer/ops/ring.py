"""Context parallelism's self-attention: the positions of each row split over the mesh's
"context" axis, every chip holding the queries, keys and values of its share of the positions.

q [B, T, N, H], k [B, T, K, H], v [B, T, K, Hv] -> [B, T, N, Hv], global arrays whose T is
sharded over "context" (the `length` logical axis, `parallel/sharding.py`). The mask is the one
`model` builds for a training row, rebuilt here block by block from each position's index in
the row, so that no [T, T] mask exists: causal (with a prefix LM's `in_prefix`), a local window
(w or (left, right)) widened by `global_tokens`, and segment ids (packed rows; 0 = padding).
A query row with no key to attend to returns zeros, as `attention.dot_product_attention`.

Each chip attends its queries to the key/value blocks of every chip, one block at a time and
within a block a tile of queries against a tile of keys (`QUERY_TILE`, `KEY_TILE`), combined
by the online softmax (running max, sum and weighted values in float32, as
`ops/chunked.py`), inside a `jax.shard_map` over the batch axes, "context" and "tensor"
(heads). Where the blocks come from is `model.context_parallel_strategy`:

  "all_gather"  each chip gathers every chip's keys and values once (one `all_gather` per layer,
                K/V of the whole row held for the layer: small under grouped-query attention);
  "ring"        ring attention (Liu et al., 2023): the keys and values go round the ring of
                chips by `ppermute`, one block a step, so a chip holds two blocks at a time and
                the transfer of the next overlaps the compute of this one.

The backward pass is JAX's autodiff through the loops over blocks and tiles, each query
tile and each tile step rematerialised (`jax.checkpoint`): no weights are saved, only the
running statistics a tile starts from. The ring's transpose passes the key/value gradients
back round the ring. (A hand-written flash backward, as `ops/chunked.py` has, would save those
statistics too; the splash kernel does not run inside this shard_map.)

Causal load balancing (`model.context_load_balance`): under a causal mask the chip holding the
first positions would have least to do and the last most, so the decoder puts its rows in the
order of `load_balanced_order` (C chips: the row cut into 2C blocks, chip i holding blocks i
and 2C-1-i, as Megatron-LM and MaxText reorder them) before its first layer and back after its
last (`to_load_balanced`, `from_load_balanced`). Everything but attention is position-wise, and
attention reads each position's index from the same order, so the numbers do not change.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from transformer.ops.grouping import NEG_INF, group_queries
from transformer.ops.masks import window_sizes
from transformer.parallel import sharding

STRATEGIES = ("all_gather", "ring")
AXIS = sharding.LENGTH_AXIS
# Queries and keys a chip attends at once within a block (the largest divisors of its share
# up to these): memory [B, N, QUERY_TILE, KEY_TILE] float32 per step, never [T/C, T/C].
QUERY_TILE = 512
KEY_TILE = 2048


def context_shards() -> int:
    """How many ways the mesh in context (`jax.sharding.use_abstract_mesh`) splits the
    positions: its "context" size, 1 without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(AXIS, 1)


def load_balanced_order(length: int, shards: int) -> np.ndarray:
    """[T] the index in the row of the position at each slot of the load-balanced order: the
    row cut into 2C blocks, chip i (slots i*T/C ..) holding blocks i and 2C-1-i."""
    if length % (2 * shards):
        raise ValueError(f"length {length} is not a multiple of 2 x mesh.context={shards}: "
                         f"context parallelism's causal load balancing cuts every row into "
                         f"{2 * shards} equal blocks (pad the rows, or set "
                         f"model.context_load_balance=False)")
    blocks = np.arange(length).reshape(2 * shards, -1)
    return blocks[[b for i in range(shards) for b in (i, 2 * shards - 1 - i)]].reshape(-1)


def to_load_balanced(x: jax.Array, shards: int, axis: int = 1) -> jax.Array:
    """x with its `axis` (the positions) in `load_balanced_order` (as it is for 1 shard)."""
    if shards == 1:
        return x
    return jnp.take(x, load_balanced_order(x.shape[axis], shards), axis=axis)


def from_load_balanced(x: jax.Array, shards: int, axis: int = 1) -> jax.Array:
    """The inverse of `to_load_balanced`: the positions back in the row's order."""
    if shards == 1:
        return x
    return jnp.take(x, np.argsort(load_balanced_order(x.shape[axis], shards)), axis=axis)


def _allowed(q_index, k_index, q_ids, k_ids, q_prefix, k_prefix, *, causal, window,
             global_tokens):
    """[B|1, 1, 1, Tq, Sk] True = attend, for a query block at row indices q_index [Tq] and a
    key block at k_index [Sk]. The ids [B, Tq] / [B, Sk] (0 = padding) and a prefix LM's
    prefix flags as `masks.make_decoder_mask`, `make_local_mask` read them."""
    allowed = jnp.ones((1, q_index.shape[0], k_index.shape[0]), jnp.bool_)
    if causal:
        before = (k_index[None, :] <= q_index[:, None])[None]
        if q_prefix is not None:
            before = before | (q_prefix[:, :, None] & k_prefix[:, None, :])
        allowed = allowed & before
    if window is not None:
        offset = k_index[None, :] - q_index[:, None]
        near = (offset >= -window[0]) & (offset <= window[1])
        if global_tokens:
            near = near | (q_index[:, None] < global_tokens) | (k_index[None, :] < global_tokens)
        allowed = allowed & near[None]
    if q_ids is not None:
        allowed = allowed & ((q_ids[:, :, None] == k_ids[:, None, :])
                             & (q_ids != 0)[:, :, None] & (k_ids != 0)[:, None, :])
    return allowed[:, None, None]


def _tiles(x, axis: int, size: int):
    """x with `axis` cut into tiles of `size`, the tiles first: [n, ..., size, ...]."""
    if x is None:
        return None
    x = x.reshape(x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _untile(x, axis: int):
    """The inverse of `_tiles`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


@functools.partial(jax.checkpoint, static_argnums=(0,))
def _attend_block(scale, carry, q5, k, v, allowed):
    """One key/value block into the online softmax's (max, sum, weighted values)."""
    m, l, acc = carry  # [B, K, G, Tq], [B, K, G, Tq], [B, Tq, K, G, Hv] float32
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q5, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(allowed, logits, NEG_INF)
    m_new = jnp.maximum(m, logits.max(axis=-1))
    p = jnp.where(allowed, jnp.exp(logits - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    pv = jnp.einsum("BKGTS,BSKE->BTKGE", p.astype(v.dtype), v,
                    preferred_element_type=jnp.float32)
    acc = acc * jnp.moveaxis(correction, -1, 1)[..., None] + pv
    return m_new, l * correction + p.sum(axis=-1), acc


def _local(q, k, v, ids, prefix, *, strategy, causal, window, global_tokens, balanced, scale):
    """One chip's share: its queries against every chip's key/value blocks."""
    shards = jax.lax.axis_size(AXIS)
    me = jax.lax.axis_index(AXIS)
    b, t, n, _ = q.shape
    kh = k.shape[2]
    hv = v.shape[-1]
    length = t * shards
    order = load_balanced_order(length, shards) if balanced else np.arange(length)
    index = jnp.asarray(order.reshape(shards, t), jnp.int32)  # [C, T/C] the index of each slot
    q5 = group_queries(q, kh)
    stats = (b, kh, n // kh, t)
    carry = (jnp.full(stats, NEG_INF, jnp.float32), jnp.zeros(stats, jnp.float32),
             jnp.zeros((b, t, kh, n // kh, hv), jnp.float32))
    blocks = (k, v, ids, prefix)
    allowed = functools.partial(_allowed, causal=causal, window=window,
                                global_tokens=global_tokens)
    cq = math.gcd(t, QUERY_TILE)
    ck = math.gcd(t, KEY_TILE)

    def attend(carry, blocks, source):
        """The key/value block of chip `source` into the running softmax, a tile of CQ
        queries against a tile of CK keys at a time (each query tile rematerialised)."""
        k, v, k_ids, k_prefix = blocks
        keys = (_tiles(k, 1, ck), _tiles(v, 1, ck), _tiles(index[source], 0, ck),
                _tiles(k_ids, 1, ck), _tiles(k_prefix, 1, ck))
        m, l, acc = carry

        @jax.checkpoint
        def query_tile(tile):
            q_t, m_t, l_t, acc_t, q_index, q_ids, q_prefix = tile

            def step(carry_t, key_tile):
                k_t, v_t, k_index, k_ids, k_prefix = key_tile
                mask = allowed(q_index, k_index, q_ids, k_ids, q_prefix, k_prefix)
                return _attend_block(scale, carry_t, q_t, k_t, v_t, mask), None

            return jax.lax.scan(step, (m_t, l_t, acc_t), keys)[0]

        m, l, acc = jax.lax.map(query_tile, (
            _tiles(q5, 1, cq), _tiles(m, 3, cq), _tiles(l, 3, cq), _tiles(acc, 1, cq),
            _tiles(index[me], 0, cq), _tiles(ids, 1, cq), _tiles(prefix, 1, cq)))
        return _untile(m, 3), _untile(l, 3), _untile(acc, 1)

    if strategy == "all_gather":
        gathered = jax.tree.map(
            lambda x: jax.lax.all_gather(x, AXIS, axis=0, tiled=False), blocks)

        def step(carry, source):
            return attend(carry, jax.tree.map(lambda x: x[source], gathered), source), None

        carry, _ = jax.lax.scan(step, carry, jnp.arange(shards))
    else:  # ring: at step r this chip holds the blocks of chip me - r
        forward = [(i, (i + 1) % shards) for i in range(shards)]

        def step(state, r):
            carry, blocks = state
            carry = attend(carry, blocks, (me - r) % shards)
            return (carry, jax.lax.ppermute(blocks, AXIS, forward)), None

        (carry, blocks), _ = jax.lax.scan(step, (carry, blocks), jnp.arange(shards - 1))
        carry = attend(carry, blocks, (me - shards + 1) % shards)
    _, l, acc = carry
    l = jnp.moveaxis(l, -1, 1)[..., None]  # [B, T, K, G, 1]
    out = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
    return out.reshape(b, t, n, hv).astype(v.dtype)


def self_attention(q, k, v, *, causal: bool, strategy: str = "all_gather",
                   local_window_size=None, global_tokens: int = 0, segment_ids=None,
                   in_prefix=None, load_balanced: bool = False,
                   scale: float | None = None) -> jax.Array:
    """Self-attention over the mesh in context (module docstring), positions split over its
    "context" axis. segment_ids [B, T] (0 = padding), in_prefix [B, T] (a prefix LM's prefix,
    with `causal`); `load_balanced`: the rows are in `load_balanced_order`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"model.context_parallel_strategy={strategy!r} is not one of "
                         f"{', '.join(STRATEGIES)}")
    mesh = jax.sharding.get_abstract_mesh()
    shards = mesh.shape[AXIS]
    tensor = mesh.shape["tensor"]
    b, t, n, h = q.shape
    batch = sharding.batch_shards(mesh.shape)
    if t % shards or b % batch or n % tensor:
        raise ValueError(f"context parallelism splits [B, T, N] = [{b}, {t}, {n}] over mesh "
                         f"data x fsdp = {batch}, context = {shards}, tensor = {tensor}: each "
                         f"must divide its axis")
    if k.shape[2] % tensor:  # kv heads that "tensor" does not divide: one per query head
        k, v = (jnp.repeat(x, n // x.shape[2], axis=2) for x in (k, v))
    ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
    prefix = None if in_prefix is None or not causal else in_prefix.astype(jnp.bool_)
    heads = P(sharding.BATCH_AXES, AXIS, "tensor", None)
    rows = P(sharding.BATCH_AXES, AXIS)
    local = functools.partial(
        _local, strategy=strategy, causal=causal, window=window_sizes(local_window_size),
        global_tokens=global_tokens, balanced=load_balanced,
        scale=h ** -0.5 if scale is None else scale)
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, rows, rows),
                         out_specs=heads, check_vma=False)(q, k, v, ids, prefix)
