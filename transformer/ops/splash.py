"""Splash attention: the Pallas TPU flash-attention kernel, in the package's layout.

q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] (K divides N) -> [B, T, N, Hv], as
`attention.dot_product_attention` with a causal mask, a local window (`local_window_size`, w
or (left, right): the kernel's LocalMask skips the blocks outside the band) and/or segment ids
(id 0 = padding). A query row with no key to attend to returns zeros. T and S must be
multiples of BLOCK (`supports`). The kernel runs per example (vmapped over the batch) and cannot
be partitioned by XLA: on a mesh, `sharded_splash_attention` runs it in a `shard_map` over the
batch axes and "tensor" (heads). Where the program is lowered for another platform than a TPU
(a CPU: tests) it runs in Pallas interpret mode, chosen per lowering platform, so a CPU process
compiling for TPU devices (`train.py --compile_only --topology`) gets the real kernel.

`self_attention` is what `model.attention_implementation="splash"` runs (and "auto" on a TPU
mesh, `train_state.build_trainer`) in the self-attention layers it fits (`blocks`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

from transformer.ops.masks import window_sizes
from transformer.parallel import sharding

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
                     interpret: bool | None = None) -> jax.Array:
    """Attention on one device's arrays (module docstring). Segment ids [B, T] and [B, S].
    `interpret`: Pallas interpret mode (None: unless lowered for a TPU)."""
    t, n, h = q.shape[1:]
    s = k.shape[1]
    scale = h ** -0.5 if scale is None else scale
    window = window_sizes(local_window_size)
    one = _head_mask(t, s, causal, window)

    def run(qt, kt, vt, *ids, interpret: bool):
        # Grouped-query attention is native: q head n uses kv head n // (N / K).
        kernel = sa.make_splash_mha(mask=sa.MultiHeadMask([one] * n), head_shards=1,
                                    q_seq_shards=1, interpret=interpret,
                                    block_sizes=sa.BlockSizes.get_default())
        return jax.vmap(kernel)(qt, kt, vt, *(sa.SegmentIds(*ids),) if ids else ())

    qt = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)  # [B, N, T, H]
    kt = jnp.swapaxes(k, 1, 2)  # [B, K, S, H]
    vt = jnp.swapaxes(v, 1, 2)
    args = (qt, kt, vt) + (() if q_segment_ids is None else
                           (q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)))
    if interpret is None:
        out = jax.lax.platform_dependent(*args, tpu=functools.partial(run, interpret=False),
                                         default=functools.partial(run, interpret=True))
    else:
        out = run(*args, interpret=interpret)
    out = jnp.swapaxes(out, 1, 2)
    if q_segment_ids is None:
        return out
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
    """`splash_attention` in a shard_map over the batch (data, fsdp) and heads (tensor). Kv
    heads that "tensor" does not divide are repeated to N heads first."""
    tensor = mesh.shape["tensor"]
    n = q.shape[2]
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


def fits(q: jax.Array, k: jax.Array) -> bool:
    """Whether `self_attention` takes these shapes here: `supports`, and the heads and the
    batch split over the mesh in context (if any) as its shard_map splits them."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return supports(q, k)
    return (supports(q, k) and q.shape[0] % sharding.batch_shards(mesh.shape) == 0
            and q.shape[2] % mesh.shape["tensor"] == 0)


def self_attention(q, k, v, *, causal: bool, local_window_size=None,
                   segment_ids=None) -> jax.Array:
    """Self-attention by the kernel, over the mesh in context (the train step's
    `jax.sharding.use_abstract_mesh`) in a shard_map, or on one device without one. Its mask is
    what `causal`, the window and `segment_ids` [B, T] (0 = padding) imply."""
    ids = {} if segment_ids is None else dict(q_segment_ids=segment_ids,
                                              kv_segment_ids=segment_ids)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return splash_attention(q, k, v, causal=causal, local_window_size=local_window_size,
                                **ids)
    return sharded_splash_attention(q, k, v, mesh, causal=causal,
                                    local_window_size=local_window_size, **ids)
