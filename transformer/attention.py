"""Scaled dot-product attention and attention masks, as pure functions of arrays.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V            (Vaswani et al., eq. 1)

Shapes are written in the package's legend (`transformer/__init__.py`): q [B, T, N, H],
k [B, S, K, H], v [B, S, K, Hv]; grouped-query attention views q as [B, T, K, G, H].

Masks are boolean, True = attend, and broadcast to [B, N, T, S]. Logits and softmax are
float32 whatever the input dtype. A query row with no key to attend to returns zeros.

Three implementations give the same numbers:
  "xla"      the formula as einsums; materialises the [B, N, T, S] weights.
  "chunked"  memory-efficient attention in pure JAX: an online softmax over key blocks, and a
             custom VJP that recomputes the blocks in the backward pass (as flash attention
             does), so memory grows linearly with S in both passes.
  "cudnn"    cuDNN flash attention through `jax.nn.dot_product_attention` (NVIDIA GPUs).
and "auto" picks one per call from the shapes, dtype and device (`choose_implementation`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from transformer.layers import dropout

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


def attention_weights(
    q: jax.Array,
    k: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
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


def _xla_attention(q, k, v, mask, bias, scale, dropout_rate, dropout_rng):
    weights = attention_weights(q, k, mask=mask, bias=bias, scale=scale)
    weights = dropout(weights, dropout_rate, dropout_rng)
    b, n, t, s = weights.shape
    num_kv_heads = k.shape[2]
    weights = weights.reshape(b, num_kv_heads, n // num_kv_heads, t, s).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKE->BTKGE", weights, v)
    return out.reshape(b, t, n, v.shape[-1])


def _cudnn_attention(q, k, v, mask, bias, scale, dropout_rate):
    if dropout_rate > 0.0:
        raise ValueError("implementation='cudnn' has no attention dropout: set the attention "
                         "dropout rate to 0 or use implementation='xla'")
    if jax.default_backend() != "gpu":
        raise ValueError(f"implementation='cudnn' needs an NVIDIA GPU; the backend here is "
                         f"{jax.default_backend()!r}: use 'xla' or 'chunked'")
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                       implementation="cudnn")
    if mask is None:
        return out
    # jax.nn returns the mean of V on rows with nothing to attend to; we return zeros there.
    row_has_key = jnp.asarray(mask, jnp.bool_).any(axis=-1)  # [B|1, N|1, T]
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
                          dropout_rate: float = 0.0) -> str:
    """What implementation="auto" runs: "cudnn" where `cudnn_supports` the inputs, else
    "chunked" from `AUTO_CHUNKED_MIN_KEYS` keys on (where the [B, N, T, S] weights of "xla"
    would bind memory), else "xla"; always "xla" with attention dropout (only it has dropout).
    Decided at trace time from static shapes and dtypes."""
    if dropout_rate > 0.0:
        return "xla"
    if cudnn_supports(q, k, v):
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
) -> jax.Array:
    """Multi-head, grouped-query or multi-query attention.

    Args:
      q: [B, T, N, H] queries; k: [B, S, K, H] keys; v: [B, S, K, Hv] values; N % K == 0.
      mask: boolean, broadcastable to [B, N, T, S]; True = attend.
      bias: added to the logits, broadcastable to [B, N, T, S].
      scale: logit scale, 1/sqrt(H) by default.
      dropout_rate, dropout_rng: dropout on the attention weights ("xla" only).
      implementation: "xla", "chunked", "cudnn" or "auto" (module docstring).
      key_chunk_size: keys per block for "chunked".
    Returns:
      [B, T, N, Hv] in v's dtype.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B,T,N,H], [B,S,K,H], [B,S,K,Hv]; got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if implementation == "auto":
        implementation = choose_implementation(q, k, v, dropout_rate=dropout_rate)
    if implementation == "xla":
        return _xla_attention(q, k, v, mask, bias, scale, dropout_rate, dropout_rng)
    if implementation == "chunked":
        if dropout_rate > 0.0:
            raise ValueError("implementation='chunked' has no attention dropout: set the "
                             "attention dropout rate to 0 or use implementation='xla'")
        return chunked_attention(q, k, v, mask=mask, bias=bias, scale=scale,
                                 key_chunk_size=key_chunk_size)
    if implementation == "cudnn":
        return _cudnn_attention(q, k, v, mask, bias, scale, dropout_rate)
    raise ValueError(f"implementation={implementation!r}; choose one of {IMPLEMENTATIONS}")


# --------------------------------------------------------------------------- chunked


def chunked_attention(q, k, v, *, mask=None, bias=None, scale=None,
                      key_chunk_size=DEFAULT_KEY_CHUNK_SIZE):
    """Memory-efficient attention: same contract as `dot_product_attention`, no dropout."""
    b, t, n, h = q.shape
    s, num_kv_heads = k.shape[1], k.shape[2]
    scale = h ** -0.5 if scale is None else scale
    chunk = min(key_chunk_size, s)
    padded = -s % chunk
    if padded:
        # Pad keys to whole blocks; the padding is masked out.
        pad = ((0, 0), (0, padded), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        mask, bias = (None if x is None else _pad_keys(x, s, padded) for x in (mask, bias))
        mask = combine_masks(mask, jnp.arange(s + padded) < s)
    blocks = _KeyBlocks(num_kv_heads, chunk)
    out = _chunked_core(blocks, scale, _group_queries(q, num_kv_heads), k, v,
                        blocks.mask(mask), blocks.bias(bias))
    return out.reshape(b, t, n, v.shape[-1])


def _pad_keys(x, s, padded):
    """Broadcasts x's key axis to S and pads it with `padded` zeros (False for masks)."""
    x = jnp.broadcast_to(x, x.shape[:-1] + (s,))
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded)])


@dataclasses.dataclass(frozen=True)
class _KeyBlocks:
    """Splits the key axis of k, v, masks and biases into [num_blocks, ...] for lax.scan."""

    num_kv_heads: int
    chunk: int

    def kv(self, x):  # [B, S, K, H] -> [S/C, B, C, K, H]
        b, s, kh, h = x.shape
        return x.reshape(b, s // self.chunk, self.chunk, kh, h).swapaxes(0, 1)

    def _split(self, x):  # [..., T, S] (S may be 1 = broadcast) -> [S/C|1, ..., T, C|1]
        if x.shape[-1] == 1:
            return x[None]
        lead = x.shape[:-1]
        x = x.reshape(lead + (x.shape[-1] // self.chunk, self.chunk))
        return jnp.moveaxis(x, -2, 0)

    def mask(self, mask):
        return None if mask is None else self._split(_as_5d(mask, self.num_kv_heads))

    def bias(self, bias):
        return None if bias is None else self._split(_as_5d(bias, self.num_kv_heads))


def _block_logits(q, k_blk, mask_blk, bias_blk, scale):
    """Scaled, biased, masked logits of one key block: [B, K, G, T, C] float32."""
    logits = jnp.einsum("BTKGH,BCKH->BKGTC", q, k_blk,
                        preferred_element_type=jnp.float32) * scale
    if bias_blk is not None:
        logits = logits + bias_blk.astype(jnp.float32)
    if mask_blk is not None:
        logits = jnp.where(mask_blk, logits, _NEG_INF)
    return logits


def _scan_inputs(blocks, k, v, mask_blocks, bias_blocks):
    """Per-block scan inputs; broadcast (size-1) mask/bias blocks are passed as constants."""
    num = k.shape[1] // blocks.chunk
    xs = {"k": blocks.kv(k), "v": blocks.kv(v)}
    const = {"mask": None, "bias": None}
    for name, x in (("mask", mask_blocks), ("bias", bias_blocks)):
        if x is not None and x.shape[0] == num and num > 1:
            xs[name] = x
        elif x is not None:
            const[name] = x[0]
    return xs, const


def _forward(blocks, scale, q, k, v, mask_blocks, bias_blocks):
    """Online softmax over key blocks. Returns out [B,T,K,G,Hv] and logsumexp [B,K,G,T]."""
    b, t, kh, g, _ = q.shape
    xs, const = _scan_inputs(blocks, k, v, mask_blocks, bias_blocks)

    def step(carry, blk):
        m, l, acc = carry
        mask_blk = blk.get("mask", const["mask"])
        logits = _block_logits(q, blk["k"], mask_blk, blk.get("bias", const["bias"]), scale)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        p = jnp.exp(logits - m_new[..., None])
        if mask_blk is not None:
            p = jnp.where(mask_blk, p, 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        pv = jnp.einsum("BKGTC,BCKE->BTKGE", p.astype(v.dtype), blk["v"],
                        preferred_element_type=jnp.float32)
        acc = acc * correction.transpose(0, 3, 1, 2)[..., None] + pv
        return (m_new, l, acc), None

    init = (jnp.full((b, kh, g, t), _NEG_INF, jnp.float32), jnp.zeros((b, kh, g, t), jnp.float32),
            jnp.zeros((b, t, kh, g, v.shape[-1]), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, xs)
    has_key = l > 0
    out = acc / jnp.where(has_key, l, 1.0).transpose(0, 3, 1, 2)[..., None]
    logsumexp = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), jnp.inf)
    return out.astype(v.dtype), logsumexp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_core(blocks, scale, q, k, v, mask_blocks, bias_blocks):
    return _forward(blocks, scale, q, k, v, mask_blocks, bias_blocks)[0]


def _chunked_fwd(blocks, scale, q, k, v, mask_blocks, bias_blocks):
    out, logsumexp = _forward(blocks, scale, q, k, v, mask_blocks, bias_blocks)
    return out, (q, k, v, mask_blocks, bias_blocks, out, logsumexp)


def _chunked_bwd(blocks, scale, residuals, d_out):
    """Recomputes each block's weights from the saved logsumexp (flash attention's backward)."""
    q, k, v, mask_blocks, bias_blocks, out, logsumexp = residuals
    d_out = d_out.astype(jnp.float32)
    delta = jnp.einsum("BTKGE,BTKGE->BKGT", d_out, out.astype(jnp.float32))
    xs, const = _scan_inputs(blocks, k, v, mask_blocks, bias_blocks)

    def step(dq, blk):
        mask_blk, bias_blk = blk.get("mask", const["mask"]), blk.get("bias", const["bias"])
        logits = _block_logits(q, blk["k"], mask_blk, bias_blk, scale)
        p = jnp.exp(logits - logsumexp[..., None])
        if mask_blk is not None:
            p = jnp.where(mask_blk, p, 0.0)
        dv = jnp.einsum("BKGTC,BTKGE->BCKE", p, d_out)
        dp = jnp.einsum("BTKGE,BCKE->BKGTC", d_out, blk["v"].astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        dq = dq + jnp.einsum("BKGTC,BCKH->BTKGH", ds, blk["k"].astype(jnp.float32)) * scale
        dk = jnp.einsum("BKGTC,BTKGH->BCKH", ds, q.astype(jnp.float32)) * scale
        dbias = None
        if bias_blocks is not None:
            broadcast = [i for i in range(ds.ndim) if bias_blk.shape[i] == 1 != ds.shape[i]]
            dbias = jnp.sum(ds, axis=tuple(broadcast), keepdims=True)
        return dq, (dk, dv, dbias)

    dq, (dk, dv, dbias) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32), xs)
    dk = dk.swapaxes(0, 1).reshape(k.shape)
    dv = dv.swapaxes(0, 1).reshape(v.shape)
    if bias_blocks is not None:
        if bias_blocks.shape[0] == 1:  # one broadcast block: sum the per-block gradients
            dbias = dbias.sum(axis=0, keepdims=True)
        dbias = dbias.astype(bias_blocks.dtype).reshape(bias_blocks.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dbias


_chunked_core.defvjp(_chunked_fwd, _chunked_bwd)
