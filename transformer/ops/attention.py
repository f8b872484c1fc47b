"""Scaled dot-product attention, as pure functions of arrays. The masks it takes are built by
`transformer.ops.masks`.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V            (Vaswani et al., eq. 1)

Shapes are written in the package's legend (`transformer/__init__.py`): q [B, T, N, H],
k [B, S, K, H], v [B, S, K, Hv]. Grouped-query attention views q as [B, T, K, G, H].

Masks are boolean, True = attend, and broadcast to [B, N, T, S]. Logits accumulate in float32
whatever the input dtype (`preferred_element_type`), and the softmax is float32. A query row with
no key to attend to returns zeros.

Sparse patterns: `local_window_size` (w, or (left, right) as `jax.nn.dot_product_attention`
spells it) lets query t attend keys t - left .. t + right only (with any mask; a causal sliding
window is (w, 0)); `global_tokens` g beside a window lets the first g positions of a row
attend to and from every position (Longformer's global tokens); `make_local_mask` and
`make_global_mask` of `transformer.ops.masks` build the same patterns as masks. Linear
attention (`linear_attention`, Katharopoulos et al., 2020) is importable from here (the
research API, docs/research-api.md). Its home is `transformer.ops.linear_attention`.

Three implementations give the same numbers:
  "xla"      the formula as einsums. Materialises the [B, N, T, S] weights.
  "chunked"  memory-efficient attention in pure JAX (`transformer.ops.chunked`): an online
             softmax over key blocks, memory linear in S in both passes, O(T·w) with a window.
  "cudnn"    cuDNN flash attention through `jax.nn.dot_product_attention` (NVIDIA GPUs).
and "auto" picks one per call from the shapes, dtype and device (`choose_implementation`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer.ops import masks
from transformer.ops.chunked import DEFAULT_KEY_CHUNK_SIZE, chunked_attention
from transformer.ops.grouping import NEG_INF, as_5d, group_queries
from transformer.ops.layers import dropout
from transformer.ops.linear_attention import FEATURE_MAPS, linear_attention  # noqa: F401 (API)

IMPLEMENTATIONS = ("xla", "chunked", "cudnn", "auto")
AUTO_CHUNKED_MIN_KEYS = 4096  # from here "auto" prefers the chunked kernel's linear memory


# --------------------------------------------------------------------------- attention


def _with_window(mask, local_window_size, t: int, s: int, global_tokens: int = 0):
    """`mask` and the window `local_window_size` (None: no window) widened by `global_tokens`
    as one mask."""
    if local_window_size is None:
        return mask
    window = masks.make_local_mask(jnp.arange(t), jnp.arange(s), local_window_size,
                                   global_tokens)
    return masks.combine_masks(mask, window)


def attention_weights(
    q: jax.Array,
    k: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    global_tokens: int = 0,
    logit_softcap: float | None = None,
) -> jax.Array:
    """softmax(q k^T * scale + bias) over unmasked keys: [B, N, T, S], float32. With
    `logit_softcap` c the scaled logits are first capped as c * tanh(logits / c) (Gemma 2).

    Rows with no unmasked key are all zeros. This is what "xla" attention multiplies V with,
    exposed for inspection (e.g. plotting attention maps).
    """
    num_kv_heads = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = softcap(jnp.einsum("BTKGH,BSKH->BKGTS", group_queries(q, num_kv_heads), k,
                                preferred_element_type=jnp.float32) * scale, logit_softcap)
    mask = _with_window(mask, local_window_size, q.shape[1], k.shape[1], global_tokens)
    weights = _masked_softmax(logits, as_5d(mask, num_kv_heads), as_5d(bias, num_kv_heads))
    b, kh, g, t, s = weights.shape
    return weights.reshape(b, kh * g, t, s)


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(logits / cap): logits kept within (-cap, cap); None: as they are."""
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def _masked_softmax(logits: jax.Array, mask5: jax.Array | None,
                    bias5: jax.Array | None) -> jax.Array:
    """softmax over the keys (last axis) of logits [B, K, G, T, S] + bias, masked keys at 0."""
    if bias5 is not None:
        logits = logits + bias5.astype(jnp.float32)
    if mask5 is not None:
        logits = jnp.where(mask5, logits, NEG_INF)
    weights = jax.nn.softmax(logits, axis=-1)
    return weights if mask5 is None else jnp.where(mask5, weights, 0.0)


def _xla_attention(q, k, v, mask, bias, scale, dropout_rate, dropout_rng, local_window_size,
                   global_tokens, logit_softcap=None):
    weights = attention_weights(q, k, mask=mask, bias=bias, scale=scale,
                                local_window_size=local_window_size, global_tokens=global_tokens,
                                logit_softcap=logit_softcap)
    weights = dropout(weights, dropout_rate, dropout_rng)
    b, n, t, s = weights.shape
    num_kv_heads = k.shape[2]
    weights = weights.reshape(b, num_kv_heads, n // num_kv_heads, t, s).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKE->BTKGE", weights, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, v.shape[-1]).astype(v.dtype)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    mask: jax.Array | None = None, bias: jax.Array | None = None,
                    scale: float | None = None,
                    logit_softcap: float | None = None) -> jax.Array:
    """Attention over a decoding cache, whose keys and values are head-major: q [B, T, N, H],
    k [B, K, S, H], v [B, K, S, Hv] -> [B, T, N, Hv] in v's dtype; `mask` broadcastable to
    [B, N, T, S], True = attend; `bias` added to the logits, broadcastable to [B, N, T, S]
    (one row of q per row of the cache only).

    q may hold W rows per row of the cache ([B*W, T, N, H], the W rows of one cache row
    adjacent: a beam search's beams over their sentence's encoder keys and values). They are
    attended as W*T queries of that row, and `mask` must then be the same for every query
    (broadcastable to [B, N, 1, S]).

    The numbers of `dot_product_attention` with k and v in [B, S, K, H]. Heads first, a decoding
    step's two contractions are batched matrix-vector products over each head's contiguous keys
    and values. Over [B, S, K, H] they would first copy the whole cache into this layout, or
    reduce across strided memory, at every step (docs/benchmarks.md: decoding).
    """
    rows, t = q.shape[:2]
    q = q.reshape(k.shape[0], -1, *q.shape[2:])  # [B, W*T, N, H]
    num_kv_heads = k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = softcap(jnp.einsum("BTKGH,BKSH->BKGTS", group_queries(q, num_kv_heads), k,
                                preferred_element_type=jnp.float32) * scale, logit_softcap)
    if bias is not None and rows != k.shape[0]:
        raise ValueError(f"cache_attention: a bias needs one query row per cache row, got "
                         f"{rows} rows over {k.shape[0]}")
    weights = _masked_softmax(logits, as_5d(mask, num_kv_heads),
                              as_5d(bias, num_kv_heads)).astype(v.dtype)
    # Heads-first output: XLA:CPU has no bfloat16 -> float32 kernel for "->BTKGE" here.
    out = jnp.einsum("BKGTS,BKSE->BKGTE", weights, v, preferred_element_type=jnp.float32)
    return jnp.moveaxis(out, 3, 1).reshape(rows, t, q.shape[2], v.shape[-1]).astype(v.dtype)


def _cudnn_operands(q, k, v, mask, bias):
    """(q, k, v, bias, mask) as cuDNN takes them: `mask` and `bias` spanning T and S whole
    ([B|1, N|1, T, S]: jax's `check_layout`), and T and S made even where either is given (its
    backward refuses odd lengths with a mask or bias, `check_is_flash_attention`; a batch of
    256-token rows gives 255-token sources). An added key is masked out. An added query row is
    computed and dropped by the caller (`[:, :T]`)."""
    t = q.shape[1]
    s = k.shape[1]
    if mask is None and bias is None:
        return q, k, v, bias, mask
    pad_t = t % 2
    pad_s = s % 2
    q = jnp.pad(q, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    k, v = (jnp.pad(x, ((0, 0), (0, pad_s), (0, 0), (0, 0))) for x in (k, v))
    if mask is None and pad_s:
        mask = jnp.ones((1, 1, 1, s), jnp.bool_)
    if mask is not None:
        mask = _whole_logit_axes(jnp.asarray(mask, jnp.bool_), t, s, pad_t, pad_s, False)
    return q, k, v, _whole_logit_axes(bias, t, s, pad_t, pad_s, 0), mask


def _whole_logit_axes(x, t: int, s: int, pad_t: int, pad_s: int, value):
    """`x`, broadcastable to [B, N, T, S], as [B|1, N|1, T+pad_t, S+pad_s] with `value` in
    the added places (None stays None)."""
    if x is None:
        return None
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, (*x.shape[:2], t, s))
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)), constant_values=value)


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
    t = q.shape[1]
    out = jax.nn.dot_product_attention(*_cudnn_operands(q, k, v, mask, bias), scale=scale,
                                       local_window_size=local_window_size,
                                       implementation="cudnn")[:, :t]
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
    else "xla". Always "xla" with attention dropout (only it has dropout). Decided at trace
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
    logit_softcap: float | None = None,
) -> jax.Array:
    """Multi-head, grouped-query or multi-query attention.

    Args:
      q: [B, T, N, H] queries (N a multiple of K).
      k: [B, S, K, H] keys.
      v: [B, S, K, Hv] values.
      mask: boolean, broadcastable to [B, N, T, S]; True = attend.
      bias: added to the logits, broadcastable to [B, N, T, S].
      scale: logit scale, 1/sqrt(H) by default.
      dropout_rate: dropout on the attention weights ("xla" only).
      dropout_rng: the dropout key.
      implementation: "xla", "chunked", "cudnn" or "auto" (module docstring).
      key_chunk_size: keys per block for "chunked" (and queries per block with a window).
      local_window_size: w or (left, right): query t attends keys t - left .. t + right only
        (and-ed with `mask`); None: all keys.
      global_tokens: with a window, the first `global_tokens` positions of a row attend to and
        from every position (Longformer's global tokens; still and-ed with `mask`).
      logit_softcap: c caps the scaled logits as c * tanh(logits / c) (Gemma 2; "xla" only,
        which "auto" then runs).
    Returns:
      [B, T, N, Hv] in v's dtype.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B,T,N,H], [B,S,K,H], [B,S,K,Hv]; got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    window = masks.window_sizes(local_window_size)
    if global_tokens < 0 or (global_tokens and window is None):
        raise ValueError(f"global_tokens={global_tokens} must be >= 0 and widens a local window: "
                         f"set local_window_size (without one every position attends to all)")
    if logit_softcap is not None:
        if implementation not in ("xla", "auto"):
            raise ValueError(f"logit_softcap={logit_softcap} needs implementation='xla' "
                             f"(got {implementation!r})")
        implementation = "xla"
    if implementation == "auto":
        implementation = choose_implementation(q, k, v, dropout_rate=dropout_rate,
                                               local_window_size=window,
                                               global_tokens=global_tokens)
    if implementation == "xla":
        return _xla_attention(q, k, v, mask, bias, scale, dropout_rate, dropout_rng, window,
                              global_tokens, logit_softcap)
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
