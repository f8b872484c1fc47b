"""Memory-efficient attention in pure JAX: an online softmax over key blocks, and a custom VJP
that recomputes the blocks in the backward pass (as flash attention does), so memory grows
linearly with S in both passes. With a local window the queries are blocked too and each query
block visits only the key blocks that intersect its band (and those holding global tokens),
forward and backward: time and memory O(T·w), not O(T·S). `dot_product_attention(...,
implementation="chunked")` calls `chunked_attention`. Its contract is that function's.

Shapes (legend: `transformer/__init__.py`): q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv].
Blocked, Q query blocks of T' queries and key blocks of C keys.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from transformer.ops.grouping import NEG_INF, as_5d, group_queries
from transformer.ops.masks import window_sizes

DEFAULT_KEY_CHUNK_SIZE = 512


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Which key blocks each query block visits (static, from the shapes and the pattern).

    Queries form `num_q_blocks` blocks of `q_chunk` (one block of all T without a window), keys
    `num_k_blocks` blocks of `chunk`. At step j < `visits` query block i visits key block
    `table[i][j]` (steps with `valid[i][j]` False repeat a block and count nothing). With a
    window a query block visits the key blocks its band reaches and those holding the first
    `global_tokens` keys: work O(T·(w + global_tokens + chunk)), not O(T·S). Rows of global
    queries need every key: `chunked_attention` computes them apart.
    """

    t: int
    s: int
    chunk: int
    q_chunk: int
    num_q_blocks: int
    num_k_blocks: int
    visits: int
    table: tuple[tuple[int, ...], ...]
    valid: tuple[tuple[bool, ...], ...]
    window: tuple[int, int] | None
    global_tokens: int = 0

    @property
    def banded(self) -> bool:
        """Whether query blocks skip key blocks (else every block visits all of them)."""
        return self.visits < self.num_k_blocks

    @classmethod
    def make(cls, t: int, s: int, key_chunk_size: int, window, *, band: bool = True,
             global_tokens: int = 0):
        chunk = min(key_chunk_size, s)
        num_k_blocks = -(-s // chunk)
        window = window_sizes(window)
        if window is not None and band:
            left, right = window
            q_chunk = min(chunk, t)
            num_q = -(-t // q_chunk)
            first_q = np.arange(num_q) * q_chunk
            lo = np.clip(first_q - left, 0, s - 1) // chunk
            hi = np.clip(first_q + q_chunk - 1 + right, 0, s - 1) // chunk
            global_blocks = set(range(-(-min(global_tokens, s) // chunk)))
            rows = [sorted(global_blocks | set(range(a, b + 1)))
                    for a, b in zip(lo, hi, strict=True)]
            visits = max(len(row) for row in rows)
            if visits < num_k_blocks:
                table = tuple(tuple(row + row[-1:] * (visits - len(row))) for row in rows)
                valid = tuple((True,) * len(row) + (False,) * (visits - len(row))
                              for row in rows)
                return cls(t, s, chunk, q_chunk, num_q, num_k_blocks, visits, table, valid,
                           window, global_tokens)
        return cls(t, s, chunk, t, 1, num_k_blocks, num_k_blocks, (tuple(range(num_k_blocks)),),
                   ((True,) * num_k_blocks,), window, global_tokens)

    def key_blocks(self, j) -> jax.Array:
        """[num_q_blocks] the key block each query block visits at step j."""
        return jnp.asarray(self.table, jnp.int32)[:, j]

    def allowed(self, blocks: jax.Array, j) -> jax.Array:
        """[Q, 1, 1, 1, q_chunk, chunk]: real keys (not padding) of a valid step, inside the
        window or global."""
        q_pos = (jnp.arange(self.num_q_blocks) * self.q_chunk)[:, None] + jnp.arange(self.q_chunk)
        k_pos = blocks[:, None] * self.chunk + jnp.arange(self.chunk)
        real = (k_pos < self.s) & jnp.asarray(self.valid)[:, j, None]
        ok = jnp.broadcast_to(real[:, None, :], (self.num_q_blocks, self.q_chunk, self.chunk))
        if self.window is not None:
            offset = k_pos[:, None, :] - q_pos[:, :, None]
            ok = ok & (((offset >= -self.window[0]) & (offset <= self.window[1]))
                       | (k_pos[:, None, :] < self.global_tokens)
                       | (q_pos[:, :, None] < self.global_tokens))
        return ok[:, None, None, None]

    def view(self, x, fill):
        """A mask or bias broadcastable to [B, K, G, T, S] -> [Q|1, S/C|1, B, K, G, Cq|1, C|1]
        (Q query blocks of Cq, S/C key blocks of C), padded with `fill`."""
        b, kh, g, t, s = x.shape
        tp, sp = (self.num_q_blocks * self.q_chunk if t > 1 else 1,
                  self.num_k_blocks * self.chunk if s > 1 else 1)
        x = jnp.pad(x, [(0, 0)] * 3 + [(0, tp - t), (0, sp - s)], constant_values=fill)
        x = x.reshape(b, kh, g, tp // self.q_chunk if t > 1 else 1, min(tp, self.q_chunk),
                      sp // self.chunk if s > 1 else 1, min(sp, self.chunk))
        return x.transpose(3, 5, 0, 1, 2, 4, 6)

    def fetch(self, view, blocks):
        """The blocks of a `view` that step `blocks` visits: [Q|1, B, K, G, Cq|1, C|1]."""
        if view is None:
            return None
        if view.shape[1] == 1:
            return view[:, 0]
        if view.shape[0] == 1:
            return view[0][blocks]
        return view[jnp.arange(self.num_q_blocks), blocks]


def chunked_attention(q, k, v, *, mask=None, bias=None, scale=None,
                      key_chunk_size=DEFAULT_KEY_CHUNK_SIZE, local_window_size=None,
                      global_tokens=0):
    """Memory-efficient attention: same contract as `dot_product_attention`, no dropout.

    With a window and no bias, only the key blocks that intersect each query block's band, or
    hold global keys, are visited (`BlockPlan`). The rows of the global queries, which attend
    to every key, are then a second, unbanded pass over those rows only. With a bias all key
    blocks are visited (the pattern still applies), so that the bias gradient keeps one block
    per key block.
    """
    t = q.shape[1]
    s = k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    plan = BlockPlan.make(t, s, key_chunk_size, window_sizes(local_window_size),
                          band=bias is None, global_tokens=global_tokens)
    out = _chunked(plan, scale, q, k, v, mask, bias)
    rows = min(global_tokens, t)
    if plan.banded and rows:
        full = BlockPlan.make(rows, s, key_chunk_size, None)
        out_global = _chunked(full, scale, q[:, :rows], k, v, _first_rows(mask, rows), None)
        out = jnp.concatenate([out_global, out[:, rows:]], axis=1)
    return out


def _first_rows(x, rows: int):
    """A mask broadcastable to [B, N, T, S] -> to [B, N, rows, S] (the first query rows)."""
    if x is None:
        return None
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    return x if x.shape[2] == 1 else x[:, :, :rows]


def _chunked(plan, scale, q, k, v, mask, bias):
    """`chunked_attention` over the blocks of `plan`: q [B, T, N, H] ... -> [B, T, N, Hv]."""
    b, t, n, _ = q.shape
    s = k.shape[1]
    num_kv_heads = k.shape[2]
    q5 = group_queries(q, num_kv_heads)
    q5 = jnp.pad(q5, [(0, 0), (0, plan.num_q_blocks * plan.q_chunk - t)] + [(0, 0)] * 3)
    q5 = q5.reshape((b, plan.num_q_blocks, plan.q_chunk) + q5.shape[2:]).swapaxes(0, 1)
    pad = ((0, 0), (0, plan.num_k_blocks * plan.chunk - s), (0, 0), (0, 0))

    def key_blocks(x):  # [B, S, K, H] -> [S/C, B, C, K, H]
        x = jnp.pad(x, pad)
        return x.reshape((b, plan.num_k_blocks, plan.chunk) + x.shape[2:]).swapaxes(0, 1)

    mask_view = None if mask is None else plan.view(as_5d(mask, num_kv_heads), False)
    bias_view = None if bias is None else plan.view(as_5d(bias, num_kv_heads), 0)
    out = _chunked_core(plan, scale, q5, key_blocks(k), key_blocks(v), mask_view, bias_view)
    out = out.swapaxes(0, 1).reshape(b, plan.num_q_blocks * plan.q_chunk, n, v.shape[-1])
    return out[:, :t]


def _block_logits(plan, scale, q, k_blocks, mask_view, bias_view, blocks, j):
    """Scaled, biased, masked logits of the visited key blocks: [Q, B, K, G, Cq, C] float32,
    and the mask applied ([Q, B|1, K|1, G|1, Cq, C])."""
    logits = jnp.einsum("QBTKGH,QBCKH->QBKGTC", q, k_blocks[blocks],
                        preferred_element_type=jnp.float32) * scale
    bias_blk = plan.fetch(bias_view, blocks)
    if bias_blk is not None:
        logits = logits + bias_blk.astype(jnp.float32)
    allowed = plan.allowed(blocks, j)
    mask_blk = plan.fetch(mask_view, blocks)
    if mask_blk is not None:
        allowed = allowed & mask_blk
    return jnp.where(allowed, logits, NEG_INF), allowed


def _forward(plan, scale, q, k_blocks, v_blocks, mask_view, bias_view):
    """Online softmax over the visited key blocks. Returns out [Q, B, Cq, K, G, Hv] and the
    logsumexp [Q, B, K, G, Cq]."""
    nq, b, cq, kh, g, _ = q.shape

    def step(carry, j):
        m, l, acc = carry
        blocks = plan.key_blocks(j)
        logits, allowed = _block_logits(plan, scale, q, k_blocks, mask_view, bias_view,
                                        blocks, j)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        p = jnp.where(allowed, jnp.exp(logits - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        pv = jnp.einsum("QBKGTC,QBCKE->QBTKGE", p.astype(v_blocks.dtype), v_blocks[blocks],
                        preferred_element_type=jnp.float32)
        acc = acc * jnp.moveaxis(correction, -1, 2)[..., None] + pv
        return (m_new, l, acc), None

    stats = (nq, b, kh, g, cq)
    init = (jnp.full(stats, NEG_INF, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((nq, b, cq, kh, g, v_blocks.shape[-1]), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, jnp.arange(plan.visits))
    has_key = l > 0
    out = acc / jnp.moveaxis(jnp.where(has_key, l, 1.0), -1, 2)[..., None]
    logsumexp = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), jnp.inf)
    return out.astype(v_blocks.dtype), logsumexp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_core(plan, scale, q, k_blocks, v_blocks, mask_view, bias_view):
    return _forward(plan, scale, q, k_blocks, v_blocks, mask_view, bias_view)[0]


def _chunked_fwd(plan, scale, q, k_blocks, v_blocks, mask_view, bias_view):
    out, logsumexp = _forward(plan, scale, q, k_blocks, v_blocks, mask_view, bias_view)
    return out, (q, k_blocks, v_blocks, mask_view, bias_view, out, logsumexp)


def _chunked_bwd(plan, scale, residuals, d_out):
    """Recomputes each visited block's weights from the saved logsumexp (flash attention's
    backward). Key-block gradients are added where the blocks were read from."""
    q, k_blocks, v_blocks, mask_view, bias_view, out, logsumexp = residuals
    d_out = d_out.astype(jnp.float32)
    delta = jnp.moveaxis(jnp.einsum("QBTKGE,QBTKGE->QBTKG", d_out, out.astype(jnp.float32)),
                         2, -1)  # [Q, B, K, G, Cq]

    def step(carry, j):
        dq, dk, dv = carry
        blocks = plan.key_blocks(j)
        logits, allowed = _block_logits(plan, scale, q, k_blocks, mask_view, bias_view,
                                        blocks, j)
        p = jnp.where(allowed, jnp.exp(logits - logsumexp[..., None]), 0.0)
        dv = dv.at[blocks].add(jnp.einsum("QBKGTC,QBTKGE->QBCKE", p, d_out))
        dp = jnp.einsum("QBTKGE,QBCKE->QBKGTC", d_out, v_blocks[blocks].astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        dq = dq + jnp.einsum("QBKGTC,QBCKH->QBTKGH", ds,
                             k_blocks[blocks].astype(jnp.float32)) * scale
        dk = dk.at[blocks].add(jnp.einsum("QBKGTC,QBTKGH->QBCKH", ds,
                                          q.astype(jnp.float32)) * scale)
        dbias = None
        if bias_view is not None:  # one query block (BlockPlan.make): block j is key block j
            bias_blk = plan.fetch(bias_view, blocks)
            broadcast = [i for i in range(ds.ndim) if bias_blk.shape[i] == 1 != ds.shape[i]]
            dbias = jnp.sum(ds, axis=tuple(broadcast), keepdims=True)
        return (dq, dk, dv), dbias

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k_blocks.shape, jnp.float32),
            jnp.zeros(v_blocks.shape, jnp.float32))
    (dq, dk, dv), dbias = jax.lax.scan(step, init, jnp.arange(plan.visits))
    if bias_view is not None:
        dbias = dbias.swapaxes(0, 1)  # [Q|1, S/C, ...], as the view
        if bias_view.shape[1] == 1:  # one broadcast key block: sum the per-block gradients
            dbias = dbias.sum(axis=1, keepdims=True)
        dbias = dbias.astype(bias_view.dtype).reshape(bias_view.shape)
    return (dq.astype(q.dtype), dk.astype(k_blocks.dtype), dv.astype(v_blocks.dtype), None,
            dbias)


_chunked_core.defvjp(_chunked_fwd, _chunked_bwd)
