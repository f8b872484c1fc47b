"""Scaled dot-product attention and attention masks, as pure functions of arrays.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V            (Vaswani et al., eq. 1)

Shapes are written in the package's legend (`transformer/__init__.py`): q [B, T, N, H],
k [B, S, K, H], v [B, S, K, Hv]; grouped-query attention views q as [B, T, K, G, H].

Masks are boolean, True = attend, and broadcast to [B, N, T, S]. Logits accumulate in float32
whatever the input dtype (`preferred_element_type`), and the softmax is float32. A query row with
no key to attend to returns zeros.

Sparse patterns: `local_window_size` (w, or (left, right) as `jax.nn.dot_product_attention`
spells it) lets query t attend keys t - left .. t + right only (with any mask; a causal sliding
window is (w, 0)); `make_local_mask` and `make_global_mask` (Longformer's global tokens) build
the same patterns as masks. Linear attention (`linear_attention`, Katharopoulos et al., 2020)
is importable from here (the API of DESIGN.md); its home is `transformer.linear_attention`.

Three implementations give the same numbers:
  "xla"      the formula as einsums; materialises the [B, N, T, S] weights.
  "chunked"  memory-efficient attention in pure JAX: an online softmax over key blocks, and a
             custom VJP that recomputes the blocks in the backward pass (as flash attention
             does), so memory grows linearly with S in both passes. With a local window the
             queries are blocked too and each query block visits only the key blocks that
             intersect its band, forward and backward: time and memory O(T·w), not O(T·S).
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

IMPLEMENTATIONS = ("xla", "chunked", "cudnn", "auto")
DEFAULT_KEY_CHUNK_SIZE = 512
AUTO_CHUNKED_MIN_KEYS = 4096  # from here "auto" prefers the chunked kernel's linear memory
_NEG_INF = float(jnp.finfo(jnp.float32).min)


# --------------------------------------------------------------------------- masks


def make_causal_mask(length: int) -> jax.Array:
    """[1, 1, T, T]: query t attends to keys s <= t."""
    return jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))[None, None]


def make_padding_mask(q_valid: jax.Array, kv_valid: jax.Array) -> jax.Array:
    """[B, 1, T, S] from q_valid [B, T] and kv_valid [B, S] (True or nonzero = real token)."""
    q_valid, kv_valid = q_valid.astype(jnp.bool_), kv_valid.astype(jnp.bool_)
    return (q_valid[:, None, :, None] & kv_valid[:, None, None, :])


def make_segment_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array) -> jax.Array:
    """[B, 1, T, S] for packed rows: attend within the same segment; segment id 0 is padding."""
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
                    local_window_size: int | tuple[int, int]) -> jax.Array:
    """[1, 1, T, S] ([B, 1, T, S] from [B, T] / [B, S] positions): a query at position t attends
    the keys at positions t - left .. t + right (a sliding window; causal: (w, 0)).

    q_positions [T] or [B, T], kv_positions [S] or [B, S]; `make_local_mask(jnp.arange(T),
    jnp.arange(S), w)` is what `local_window_size=w` applies.
    """
    left, right = window_sizes(local_window_size)
    offset = kv_positions[..., None, :] - q_positions[..., :, None]  # [..., T, S]
    mask = (offset >= -left) & (offset <= right)
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
                           in_prefix: jax.Array | None = None) -> jax.Array:
    """[B, 1, T, S], incremental decoding's self-attention for a local layer: the T new queries
    at positions index..index+T-1 attend the S keys at `kv_positions` [B, S] (a ring buffer's
    slots, then the T new tokens; -1 = empty or not kept) that are within their window and not
    after them. in_prefix [B, T]: the new tokens that form a prefix LM's prefix, which also
    attend to the later ones within the window (the whole prefix comes in one call)."""
    q_positions = index + jnp.arange(query_length)
    mask = make_local_mask(q_positions, kv_positions, local_window_size)
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


def _with_window(mask, local_window_size, t: int, s: int):
    """`mask` and the window `local_window_size` (None: no window) as one mask."""
    if local_window_size is None:
        return mask
    return combine_masks(mask, make_local_mask(jnp.arange(t), jnp.arange(s), local_window_size))


def attention_weights(
    q: jax.Array,
    k: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
) -> jax.Array:
    """softmax(q k^T * scale + bias) over unmasked keys: [B, N, T, S], float32.

    Rows with no unmasked key are all zeros. This is what "xla" attention multiplies V with,
    exposed for inspection (e.g. plotting attention maps).
    """
    num_kv_heads = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum(
        "BTKGH,BSKH->BKGTS", _group_queries(q, num_kv_heads), k,
        preferred_element_type=jnp.float32,
    ) * scale
    mask = _with_window(mask, local_window_size, q.shape[1], k.shape[1])
    bias5, mask5 = _as_5d(bias, num_kv_heads), _as_5d(mask, num_kv_heads)
    if bias5 is not None:
        logits = logits + bias5.astype(jnp.float32)
    if mask5 is not None:
        logits = jnp.where(mask5, logits, _NEG_INF)
    weights = jax.nn.softmax(logits, axis=-1)
    if mask5 is not None:
        weights = jnp.where(mask5, weights, 0.0)
    b, kh, g, t, s = weights.shape
    return weights.reshape(b, kh * g, t, s)


def _xla_attention(q, k, v, mask, bias, scale, dropout_rate, dropout_rng, local_window_size):
    weights = attention_weights(q, k, mask=mask, bias=bias, scale=scale,
                                local_window_size=local_window_size)
    weights = dropout(weights, dropout_rate, dropout_rng)
    b, n, t, s = weights.shape
    num_kv_heads = k.shape[2]
    weights = weights.reshape(b, num_kv_heads, n // num_kv_heads, t, s).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKE->BTKGE", weights, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, v.shape[-1]).astype(v.dtype)


def _cudnn_attention(q, k, v, mask, bias, scale, dropout_rate, local_window_size):
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
                          local_window_size: tuple[int, int] | None = None) -> str:
    """What implementation="auto" runs: "cudnn" where `cudnn_supports` the inputs (and the
    window, if any, looks back only), else "chunked" from `AUTO_CHUNKED_MIN_KEYS` keys on (where
    the [B, N, T, S] weights of "xla" would bind memory), else "xla"; always "xla" with
    attention dropout (only it has dropout). Decided at trace time from static shapes and
    dtypes."""
    if dropout_rate > 0.0:
        return "xla"
    if cudnn_supports(q, k, v) and (local_window_size is None or local_window_size[1] == 0):
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
    Returns:
      [B, T, N, Hv] in v's dtype.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B,T,N,H], [B,S,K,H], [B,S,K,Hv]; got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    window = window_sizes(local_window_size)
    if implementation == "auto":
        implementation = choose_implementation(q, k, v, dropout_rate=dropout_rate,
                                               local_window_size=window)
    if implementation == "xla":
        return _xla_attention(q, k, v, mask, bias, scale, dropout_rate, dropout_rng, window)
    if implementation == "chunked":
        if dropout_rate > 0.0:
            raise ValueError("implementation='chunked' has no attention dropout: set the "
                             "attention dropout rate to 0 or use implementation='xla'")
        return chunked_attention(q, k, v, mask=mask, bias=bias, scale=scale,
                                 key_chunk_size=key_chunk_size, local_window_size=window)
    if implementation == "cudnn":
        return _cudnn_attention(q, k, v, mask, bias, scale, dropout_rate, window)
    raise ValueError(f"implementation={implementation!r}; choose one of {IMPLEMENTATIONS}")


# --------------------------------------------------------------------------- chunked


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Which key blocks each query block visits (static, from the shapes and the window).

    Queries form `num_q_blocks` blocks of `q_chunk` (one block of all T without a window), keys
    `num_k_blocks` blocks of `chunk`; query block i visits the `visits` key blocks
    starts[i] .. starts[i] + visits - 1, which cover every key its band can reach. Without a
    window every query block visits all key blocks: work O(T·S); with one, O(T·(w + chunk)).
    """

    t: int
    s: int
    chunk: int
    q_chunk: int
    num_q_blocks: int
    num_k_blocks: int
    visits: int
    starts: tuple[int, ...]
    window: tuple[int, int] | None

    @classmethod
    def make(cls, t: int, s: int, key_chunk_size: int, window, *, band: bool = True):
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
            visits = int((hi - lo).max()) + 1
            if visits < num_k_blocks:
                starts = np.minimum(lo, num_k_blocks - visits)
                return cls(t, s, chunk, q_chunk, num_q, num_k_blocks, visits,
                           tuple(int(i) for i in starts), window)
        return cls(t, s, chunk, t, 1, num_k_blocks, num_k_blocks, (0,), window)

    def key_blocks(self, j) -> jax.Array:
        """[num_q_blocks] the key block each query block visits at step j."""
        return jnp.asarray(self.starts, jnp.int32) + j

    def allowed(self, blocks: jax.Array) -> jax.Array:
        """[Q, 1, 1, 1, q_chunk, chunk]: real keys (not padding) inside the window."""
        q_pos = (jnp.arange(self.num_q_blocks) * self.q_chunk)[:, None] + jnp.arange(self.q_chunk)
        k_pos = blocks[:, None] * self.chunk + jnp.arange(self.chunk)
        ok = jnp.broadcast_to(k_pos[:, None, :] < self.s, (self.num_q_blocks, self.q_chunk,
                                                           self.chunk))
        if self.window is not None:
            offset = k_pos[:, None, :] - q_pos[:, :, None]
            ok = ok & (offset >= -self.window[0]) & (offset <= self.window[1])
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
                      key_chunk_size=DEFAULT_KEY_CHUNK_SIZE, local_window_size=None):
    """Memory-efficient attention: same contract as `dot_product_attention`, no dropout.

    With a window and no bias, only the key blocks that intersect each query block's band are
    visited (`BlockPlan`); with a bias all are (the window still applies), so that the bias
    gradient keeps one block per key block.
    """
    b, t, n, h = q.shape
    s, num_kv_heads = k.shape[1], k.shape[2]
    scale = h ** -0.5 if scale is None else scale
    plan = BlockPlan.make(t, s, key_chunk_size, window_sizes(local_window_size),
                          band=bias is None)
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


def _block_logits(plan, scale, q, k_blocks, mask_view, bias_view, blocks):
    """Scaled, biased, masked logits of the visited key blocks: [Q, B, K, G, Cq, C] float32,
    and the mask applied ([Q, B|1, K|1, G|1, Cq, C])."""
    logits = jnp.einsum("QBTKGH,QBCKH->QBKGTC", q, k_blocks[blocks],
                        preferred_element_type=jnp.float32) * scale
    bias_blk = plan.fetch(bias_view, blocks)
    if bias_blk is not None:
        logits = logits + bias_blk.astype(jnp.float32)
    allowed = plan.allowed(blocks)
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
        logits, allowed = _block_logits(plan, scale, q, k_blocks, mask_view, bias_view, blocks)
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
        logits, allowed = _block_logits(plan, scale, q, k_blocks, mask_view, bias_view, blocks)
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
