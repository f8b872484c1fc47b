"""Scaled dot-product attention, as pure functions of arrays (the masks: `transformer.masks`,
re-exported here).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V            (Vaswani et al., eq. 1)

Shapes are written in the package's legend (`transformer/__init__.py`): q [B, T, N, H],
k [B, S, K, H], v [B, S, K, Hv]; grouped-query attention views q as [B, T, K, G, H].

Masks are boolean, True = attend, and broadcast to [B, N, T, S]. Logits accumulate in float32
whatever the input dtype (`preferred_element_type`), and the softmax is float32. A query row with
no key to attend to returns zeros.

Sparse patterns: `local_window_size` (w, or (left, right) as `jax.nn.dot_product_attention`
spells it) lets query t attend keys t - left .. t + right only (with any mask; a causal sliding
window is (w, 0)); `global_tokens` g beside a window lets the first g positions of a row
attend to and from every position (Longformer's global tokens); `make_local_mask` and
`make_global_mask` build the same patterns as masks. Linear attention (`linear_attention`,
Katharopoulos et al., 2020) is importable from here (the API of DESIGN.md); its home is
`transformer.linear_attention`.

Three implementations give the same numbers:
  "xla"      the formula as einsums; materialises the [B, N, T, S] weights.
  "chunked"  memory-efficient attention in pure JAX: an online softmax over key blocks, and a
             custom VJP that recomputes the blocks in the backward pass (as flash attention
             does), so memory grows linearly with S in both passes. With a local window the
             queries are blocked too and each query block visits only the key blocks that
             intersect its band (and those holding global tokens), forward and backward: time
             and memory O(T·w), not O(T·S).
  "cudnn"    cuDNN flash attention through `jax.nn.dot_product_attention` (NVIDIA GPUs).
and "auto" picks one per call from the shapes, dtype and device (`choose_implementation`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from transformer.layers import dropout
from transformer.linear_attention import FEATURE_MAPS, linear_attention  # noqa: F401 (API)
from transformer.masks import (  # noqa: F401 (API: every mask importable from here)
    combine_masks,
    make_cache_mask,
    make_causal_mask,
    make_decoder_mask,
    make_global_mask,
    make_local_mask,
    make_padding_mask,
    make_prefix_lm_mask,
    make_segment_mask,
    make_window_cache_mask,
    window_sizes,
)

IMPLEMENTATIONS = ("xla", "chunked", "cudnn", "auto")
DEFAULT_KEY_CHUNK_SIZE = 512
AUTO_CHUNKED_MIN_KEYS = 4096  # from here "auto" prefers the chunked kernel's linear memory
_NEG_INF = float(jnp.finfo(jnp.float32).min)


# --------------------------------------------------------------------------- attention


def _group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, T, N, H] -> [B, T, K, G, H]; query head n uses kv head n // G."""
    b, t, n, h = q.shape
    if n % num_kv_heads:
        raise ValueError(f"query heads N={n} must be a multiple of kv heads K={num_kv_heads}")
    return q.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def _as_5d(x: jax.Array | None, num_kv_heads: int) -> jax.Array | None:
    """A mask or bias broadcastable to [B, N, T, S] -> broadcastable to [B, K, G, T, S]."""
    if x is None:
        return None
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, n, t, s = x.shape
    if n == 1:
        return x[:, :, None]
    return x.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def _with_window(mask, local_window_size, t: int, s: int, global_tokens: int = 0):
    """`mask` and the window `local_window_size` (None: no window) widened by `global_tokens`
    as one mask."""
    if local_window_size is None:
        return mask
    return combine_masks(mask, make_local_mask(jnp.arange(t), jnp.arange(s), local_window_size,
                                               global_tokens))


def attention_weights(
    q: jax.Array,
    k: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    global_tokens: int = 0,
) -> jax.Array:
    """softmax(q k^T * scale + bias) over unmasked keys: [B, N, T, S], float32.

    Rows with no unmasked key are all zeros. This is what "xla" attention multiplies V with,
    exposed for inspection (e.g. plotting attention maps).
    """
    num_kv_heads = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", _group_queries(q, num_kv_heads), k,
                        preferred_element_type=jnp.float32) * scale
    mask = _with_window(mask, local_window_size, q.shape[1], k.shape[1], global_tokens)
    weights = _masked_softmax(logits, _as_5d(mask, num_kv_heads), _as_5d(bias, num_kv_heads))
    b, kh, g, t, s = weights.shape
    return weights.reshape(b, kh * g, t, s)


def _masked_softmax(logits: jax.Array, mask5: jax.Array | None,
                    bias5: jax.Array | None) -> jax.Array:
    """softmax over the keys (last axis) of logits [B, K, G, T, S] + bias, masked keys at 0."""
    if bias5 is not None:
        logits = logits + bias5.astype(jnp.float32)
    if mask5 is not None:
        logits = jnp.where(mask5, logits, _NEG_INF)
    weights = jax.nn.softmax(logits, axis=-1)
    return weights if mask5 is None else jnp.where(mask5, weights, 0.0)


def _xla_attention(q, k, v, mask, bias, scale, dropout_rate, dropout_rng, local_window_size,
                   global_tokens):
    weights = attention_weights(q, k, mask=mask, bias=bias, scale=scale,
                                local_window_size=local_window_size, global_tokens=global_tokens)
    weights = dropout(weights, dropout_rate, dropout_rng)
    b, n, t, s = weights.shape
    num_kv_heads = k.shape[2]
    weights = weights.reshape(b, num_kv_heads, n // num_kv_heads, t, s).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKE->BTKGE", weights, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, v.shape[-1]).astype(v.dtype)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    mask: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """Attention over a decoding cache, whose keys and values are head-major: q [B, T, N, H],
    k [B, K, S, H], v [B, K, S, Hv] -> [B, T, N, Hv] in v's dtype; `mask` broadcastable to
    [B, N, T, S], True = attend.

    q may hold W rows per row of the cache ([B*W, T, N, H], the W rows of one cache row
    adjacent: a beam search's beams over their sentence's encoder keys and values); they are
    attended as W*T queries of that row, and `mask` must then be the same for every query
    (broadcastable to [B, N, 1, S]).

    The numbers of `dot_product_attention` with k and v in [B, S, K, H]. Heads first, a decoding
    step's two contractions are batched matrix-vector products over each head's contiguous keys
    and values; over [B, S, K, H] they would first copy the whole cache into this layout, or
    reduce across strided memory, at every step (README, Benchmarks: decoding).
    """
    rows, t = q.shape[:2]
    q = q.reshape(k.shape[0], -1, *q.shape[2:])  # [B, W*T, N, H]
    num_kv_heads = k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("BTKGH,BKSH->BKGTS", _group_queries(q, num_kv_heads), k,
                        preferred_element_type=jnp.float32) * scale
    weights = _masked_softmax(logits, _as_5d(mask, num_kv_heads), None).astype(v.dtype)
    # Heads-first output: XLA:CPU has no bfloat16 -> float32 kernel for "->BTKGE" here.
    out = jnp.einsum("BKGTS,BKSE->BKGTE", weights, v, preferred_element_type=jnp.float32)
    return jnp.moveaxis(out, 3, 1).reshape(rows, t, q.shape[2], v.shape[-1]).astype(v.dtype)


def _cudnn_attention(q, k, v, mask, bias, scale, dropout_rate, local_window_size,
                     global_tokens):
    if global_tokens:
        raise ValueError(f"implementation='cudnn' has no global tokens (global_tokens="
                         f"{global_tokens}): use 'chunked' or 'xla'")
    if dropout_rate > 0.0:
        raise ValueError("implementation='cudnn' has no attention dropout: set the attention "
                         "dropout rate to 0 or use implementation='xla'")
    if jax.default_backend() != "gpu":
        raise ValueError(f"implementation='cudnn' needs an NVIDIA GPU; the backend here is "
                         f"{jax.default_backend()!r}: use 'xla' or 'chunked'")
    if local_window_size is not None and local_window_size[1] > 0:
        raise ValueError(f"implementation='cudnn' takes sliding windows that look back only, "
                         f"(w, 0); got local_window_size={local_window_size}: use 'chunked'")
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                       local_window_size=local_window_size,
                                       implementation="cudnn")
    if mask is None:
        return out  # every row has a key: itself, or with a window its band
    # jax.nn returns the mean of V on rows with nothing to attend to; we return zeros there.
    mask = _with_window(jnp.asarray(mask, jnp.bool_), local_window_size, q.shape[1], k.shape[1])
    row_has_key = mask.any(axis=-1)  # [B|1, N|1, T]
    row_has_key = jnp.broadcast_to(row_has_key, (q.shape[0], q.shape[2], q.shape[1]))
    return out * row_has_key.transpose(0, 2, 1)[..., None].astype(out.dtype)


def cudnn_supports(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether cuDNN flash attention runs these inputs: an NVIDIA GPU of compute capability
    8.0 or newer (Ampere, Hopper, ...), bfloat16 or float16, equal head dims that are a multiple
    of 8 and at most 128."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    return (device.platform == "gpu" and capability is not None
            and float(capability) >= 8.0
            and q.dtype in (jnp.bfloat16, jnp.float16) and q.dtype == k.dtype == v.dtype
            and q.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128)


def choose_implementation(q: jax.Array, k: jax.Array, v: jax.Array, *,
                          dropout_rate: float = 0.0,
                          local_window_size: tuple[int, int] | None = None,
                          global_tokens: int = 0) -> str:
    """What implementation="auto" runs: "cudnn" where `cudnn_supports` the inputs (and the
    window, if any, looks back only, without global tokens), else "chunked" from
    `AUTO_CHUNKED_MIN_KEYS` keys on (where the [B, N, T, S] weights of "xla" would bind memory),
    else "xla"; always "xla" with attention dropout (only it has dropout). Decided at trace
    time from static shapes and dtypes."""
    if dropout_rate > 0.0:
        return "xla"
    if (cudnn_supports(q, k, v) and not global_tokens
            and (local_window_size is None or local_window_size[1] == 0)):
        return "cudnn"
    return "chunked" if k.shape[1] >= AUTO_CHUNKED_MIN_KEYS else "xla"


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    implementation: str = "xla",
    key_chunk_size: int = DEFAULT_KEY_CHUNK_SIZE,
    local_window_size: int | tuple[int, int] | None = None,
    global_tokens: int = 0,
) -> jax.Array:
    """Multi-head, grouped-query or multi-query attention.

    Args:
      q: [B, T, N, H] queries; k: [B, S, K, H] keys; v: [B, S, K, Hv] values; N % K == 0.
      mask: boolean, broadcastable to [B, N, T, S]; True = attend.
      bias: added to the logits, broadcastable to [B, N, T, S].
      scale: logit scale, 1/sqrt(H) by default.
      dropout_rate, dropout_rng: dropout on the attention weights ("xla" only).
      implementation: "xla", "chunked", "cudnn" or "auto" (module docstring).
      key_chunk_size: keys per block for "chunked" (and queries per block with a window).
      local_window_size: w or (left, right): query t attends keys t - left .. t + right only
        (and-ed with `mask`); None: all keys.
      global_tokens: with a window, the first `global_tokens` positions of a row attend to and
        from every position (Longformer's global tokens; still and-ed with `mask`).
    Returns:
      [B, T, N, Hv] in v's dtype.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B,T,N,H], [B,S,K,H], [B,S,K,Hv]; got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    window = window_sizes(local_window_size)
    if global_tokens < 0 or (global_tokens and window is None):
        raise ValueError(f"global_tokens={global_tokens} must be >= 0 and widens a local window: "
                         f"set local_window_size (without one every position attends to all)")
    if implementation == "auto":
        implementation = choose_implementation(q, k, v, dropout_rate=dropout_rate,
                                               local_window_size=window,
                                               global_tokens=global_tokens)
    if implementation == "xla":
        return _xla_attention(q, k, v, mask, bias, scale, dropout_rate, dropout_rng, window,
                              global_tokens)
    if implementation == "chunked":
        if dropout_rate > 0.0:
            raise ValueError("implementation='chunked' has no attention dropout: set the "
                             "attention dropout rate to 0 or use implementation='xla'")
        return chunked_attention(q, k, v, mask=mask, bias=bias, scale=scale,
                                 key_chunk_size=key_chunk_size, local_window_size=window,
                                 global_tokens=global_tokens)
    if implementation == "cudnn":
        return _cudnn_attention(q, k, v, mask, bias, scale, dropout_rate, window,
                                global_tokens)
    raise ValueError(f"implementation={implementation!r}; choose one of {IMPLEMENTATIONS}")


# --------------------------------------------------------------------------- chunked


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Which key blocks each query block visits (static, from the shapes and the pattern).

    Queries form `num_q_blocks` blocks of `q_chunk` (one block of all T without a window), keys
    `num_k_blocks` blocks of `chunk`; at step j < `visits` query block i visits key block
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
    hold global keys, are visited (`BlockPlan`); the rows of the global queries, which attend
    to every key, are then a second, unbanded pass over those rows only. With a bias all key
    blocks are visited (the pattern still applies), so that the bias gradient keeps one block
    per key block.
    """
    t, s = q.shape[1], k.shape[1]
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
    s, num_kv_heads = k.shape[1], k.shape[2]
    q5 = _group_queries(q, num_kv_heads)
    q5 = jnp.pad(q5, [(0, 0), (0, plan.num_q_blocks * plan.q_chunk - t)] + [(0, 0)] * 3)
    q5 = q5.reshape((b, plan.num_q_blocks, plan.q_chunk) + q5.shape[2:]).swapaxes(0, 1)
    pad = ((0, 0), (0, plan.num_k_blocks * plan.chunk - s), (0, 0), (0, 0))

    def key_blocks(x):  # [B, S, K, H] -> [S/C, B, C, K, H]
        x = jnp.pad(x, pad)
        return x.reshape((b, plan.num_k_blocks, plan.chunk) + x.shape[2:]).swapaxes(0, 1)

    mask_view = None if mask is None else plan.view(_as_5d(mask, num_kv_heads), False)
    bias_view = None if bias is None else plan.view(_as_5d(bias, num_kv_heads), 0)
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
    return jnp.where(allowed, logits, _NEG_INF), allowed


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
    init = (jnp.full(stats, _NEG_INF, jnp.float32), jnp.zeros(stats, jnp.float32),
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
    backward); key-block gradients are added where the blocks were read from."""
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
