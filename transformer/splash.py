"""Splash attention: the Pallas TPU flash-attention kernel, in the package's layout.

q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] (K divides N) -> [B, T, N, Hv], as
`attention.dot_product_attention` with a causal mask, a local window (`local_window_size`, w
or (left, right): the kernel's LocalMask skips the blocks outside the band) and/or segment ids
(id 0 = padding); a query row with no key to attend to returns zeros. T and S must be
multiples of BLOCK (`supports`). The kernel runs per example (vmapped over the batch) and cannot
be partitioned by XLA: on a mesh, `sharded_splash_attention` runs it in a `shard_map` over the
batch axes and "tensor" (heads). `interpret=True` runs it on a CPU (Pallas interpret mode),
for tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

from transformer import sharding
from transformer.masks import window_sizes

BLOCK = 128  # the kernel's block along T and S


def supports(q: jax.Array, k: jax.Array) -> bool:
    """Whether the kernel takes these shapes: T and S multiples of BLOCK, K dividing N."""
    return q.shape[1] % BLOCK == 0 and k.shape[1] % BLOCK == 0 and q.shape[2] % k.shape[2] == 0


def _head_mask(t: int, s: int, causal: bool, window: tuple[int, int] | None) -> sa.Mask:
    """One head's [T, S] pattern: query i attends key j <= i (causal), i - left <= j <= i + right
    (window), both, or every key."""
    if window is None:
        return sa.CausalMask((t, s)) if causal else sa.FullMask((t, s))
    left, right = window
    return sa.LocalMask((t, s), (left, 0 if causal else right), offset=0)


def splash_attention(q, k, v, *, causal: bool = False, local_window_size=None,
                     q_segment_ids=None, kv_segment_ids=None, scale: float | None = None,
                     interpret: bool = False) -> jax.Array:
    """Attention on one device's arrays (module docstring); segment ids [B, T] and [B, S]."""
    t, n, h = q.shape[1:]
    s = k.shape[1]
    scale = h ** -0.5 if scale is None else scale
    window = window_sizes(local_window_size)
    one = _head_mask(t, s, causal, window)
    # Grouped-query attention is native: q head n uses kv head n // (N / K).
    kernel = sa.make_splash_mha(mask=sa.MultiHeadMask([one] * n), head_shards=1,
                                q_seq_shards=1, interpret=interpret,
                                block_sizes=sa.BlockSizes.get_default())
    qt = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)  # [B, N, T, H]
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, S, H]
    if q_segment_ids is None:
        return jnp.swapaxes(jax.vmap(kernel)(qt, kt, vt), 1, 2)
    ids = sa.SegmentIds(q=q_segment_ids.astype(jnp.int32), kv=kv_segment_ids.astype(jnp.int32))
    out = jnp.swapaxes(jax.vmap(kernel)(qt, kt, vt, ids), 1, 2)
    # The kernel returns the mean of V on rows with nothing to attend to, and lets padding
    # (id 0) attend padding: zero both.
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]  # [B, T, S]
    offsets = jnp.arange(s)[None, :] - jnp.arange(t)[:, None]  # key index - query index
    if causal:
        same = same & (offsets <= 0)
    if window is not None:
        same = same & (offsets >= -window[0]) & (offsets <= window[1])
    row_has_key = same.any(axis=-1) & (q_segment_ids != 0)  # [B, T]
    return out * row_has_key[:, :, None, None].astype(out.dtype)


def sharded_splash_attention(q, k, v, mesh, *, q_segment_ids=None, kv_segment_ids=None,
                             **kwargs) -> jax.Array:
    """`splash_attention` in a shard_map over the batch (data, fsdp) and heads (tensor); kv
    heads that "tensor" does not divide are repeated to N heads first."""
    tensor, n = mesh.shape["tensor"], q.shape[2]
    if k.shape[2] % tensor:
        k, v = (jnp.repeat(x, n // x.shape[2], axis=2) for x in (k, v))
    heads = P(sharding.BATCH_AXES, None, "tensor", None)
    ids = P(sharding.BATCH_AXES, None)

    def local(q, k, v, *segment_ids):
        return splash_attention(q, k, v, **kwargs, **dict(zip(
            ("q_segment_ids", "kv_segment_ids"), segment_ids, strict=False)))

    args = (q, k, v) + (() if q_segment_ids is None else (q_segment_ids, kv_segment_ids))
    specs = (heads,) * 3 + (ids,) * (len(args) - 3)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=heads,
                         check_vma=False)(*args)
