"""Tests of transformer.ops.attention: the formula in numpy, jax.nn, GQA/MQA, the chunked
implementation (values and gradients), masks, dtypes, dropout and JAX transformations."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.ops import attention, masks

pytestmark = pytest.mark.usefixtures("strict_dtype_promotion")


B = 2
T = 6
S = 6
N = 4
H = 8
# The float32 tolerance used below for attention against another way of computing it
# (atol=2e-6, rtol=1e-5): a score sums H = 8 products of unit normals, ~5 in size, times
# scale 0.35. In the worst summation order it rounds by 8 x 2^-24 of that, ~8e-7. That moves
# the softmax weights by up to twice as much, relative, and an output by that times max|v|
# (~3): ~5e-6, plus S x 2^-24 for the weighted sum. Any x86-64 CPU stays inside; the
# largest error seen here was 3.5e-7.


def reference_attention(q, k, v, mask=None, bias=None, scale=None):
    """softmax(q k^T * scale + bias) v over unmasked keys, float64; fully masked rows -> 0.

    Query head n uses kv head n // (N // K).
    """
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    n = q.shape[2]
    kh = k.shape[2]
    k, v = np.repeat(k, n // kh, axis=2), np.repeat(v, n // kh, axis=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = np.einsum("BTNH,BSNH->BNTS", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    allowed = np.ones(logits.shape, bool)
    if mask is not None:
        allowed = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    logits = np.where(allowed, logits, -np.inf)
    row_max = logits.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(allowed, np.exp(logits - row_max), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    weights = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
    return np.einsum("BNTS,BSNE->BTNE", weights, v)


def qkv(seed, b=B, t=T, s=S, n=N, kh=N, h=H, hv=None, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    hv = h if hv is None else hv
    q = rng.normal(size=(b, t, n, h))
    k = rng.normal(size=(b, s, kh, h))
    v = rng.normal(size=(b, s, kh, hv))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


@functools.partial(jax.jit, static_argnames=("implementation", "key_chunk_size"))
def attend(q, k, v, mask=None, bias=None, implementation="xla", key_chunk_size=4):
    return attention.dot_product_attention(q, k, v, mask=mask, bias=bias,
                                           implementation=implementation,
                                           key_chunk_size=key_chunk_size)


# Masks for B=2, T=S=6. Batch row 0 has a padded query (and segment id 0) at position 5,
# whose row is fully masked.
Q_VALID = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], bool)
KV_VALID = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
SEGMENTS = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 2, 2, 3]], np.int32)


def np_causal(t):
    return np.tril(np.ones((t, t), bool))[None, None]


def np_padding(q_valid, kv_valid):
    return q_valid[:, None, :, None] & kv_valid[:, None, None, :]


def np_segment(q_ids, kv_ids):
    same = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    return same & np_padding(q_ids != 0, kv_ids != 0)


def mask_case(name):
    causal = masks.make_causal_mask(T)
    padding = masks.make_padding_mask(jnp.asarray(Q_VALID), jnp.asarray(KV_VALID))
    segment = masks.make_segment_mask(jnp.asarray(SEGMENTS), jnp.asarray(SEGMENTS))
    per_head = jnp.asarray(np.random.default_rng(7).random((B, N, T, S)) < 0.6)
    return {
        "none": None,
        "causal": causal,
        "padding": padding,
        "segment": segment,
        "causal+segment": masks.combine_masks(causal, segment),
        "causal+padding": masks.combine_masks(causal, padding),
        "per_head": per_head,
    }[name]


MASK_NAMES = ["none", "causal", "padding", "segment", "causal+segment", "causal+padding",
              "per_head"]


# --------------------------------------------------------------------------- masks


def test_make_causal_mask():
    mask = masks.make_causal_mask(5)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask, np_causal(5))
    assert bool(mask[0, 0, 1, 0]) and not bool(mask[0, 0, 0, 1])


def test_make_padding_mask_accepts_ints_and_bools():
    q_valid = np.array([[3, 5, 0]])  # nonzero = real token
    kv_valid = np.array([[1, 0, 7, 2]])
    mask = masks.make_padding_mask(jnp.asarray(q_valid), jnp.asarray(kv_valid))
    assert mask.shape == (1, 1, 3, 4) and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask, np_padding(q_valid != 0, kv_valid != 0))
    np.testing.assert_array_equal(
        mask[0, 0], [[1, 0, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0]])


def test_make_segment_mask_padding_never_attends_nor_is_attended():
    q_ids = np.array([[1, 1, 2, 0]])
    kv_ids = np.array([[1, 2, 2, 0, 0]])
    mask = masks.make_segment_mask(jnp.asarray(q_ids), jnp.asarray(kv_ids))
    assert mask.shape == (1, 1, 4, 5)
    np.testing.assert_array_equal(mask[0, 0], [[1, 0, 0, 0, 0],
                                               [1, 0, 0, 0, 0],
                                               [0, 1, 1, 0, 0],
                                               [0, 0, 0, 0, 0]])  # id 0 == id 0 is no match
    mask = masks.make_segment_mask(jnp.asarray(SEGMENTS), jnp.asarray(SEGMENTS))
    np.testing.assert_array_equal(mask, np_segment(SEGMENTS, SEGMENTS))


def test_make_decoder_mask_is_causal_within_segments():
    mask = masks.make_decoder_mask(jnp.asarray(SEGMENTS))
    assert mask.shape == (B, 1, T, T) and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask, np_causal(T) & np_segment(SEGMENTS, SEGMENTS))
    # A row of one sequence passes tokens != 0: causal over its real tokens.
    tokens = np.array([[7, 4, 9, 0]])
    np.testing.assert_array_equal(masks.make_decoder_mask(jnp.asarray(tokens != 0))[0, 0],
                                  [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])


def test_make_decoder_mask_of_a_prefix_lm():
    # Segment 1 = positions 0-3 with prefix 0-1; segment 2 = positions 4-5 with prefix 4.
    segments = np.array([[1, 1, 1, 1, 2, 2]])
    in_prefix = np.array([[1, 1, 0, 0, 1, 0]])
    mask = masks.make_decoder_mask(jnp.asarray(segments), jnp.asarray(in_prefix))
    np.testing.assert_array_equal(mask[0, 0], [[1, 1, 0, 0, 0, 0],
                                               [1, 1, 0, 0, 0, 0],
                                               [1, 1, 1, 0, 0, 0],
                                               [1, 1, 1, 1, 0, 0],
                                               [0, 0, 0, 0, 1, 0],
                                               [0, 0, 0, 0, 1, 1]])


def test_make_cache_mask_by_hand():
    # 2 new queries at positions 3 and 4 of a cache of 6: keys up to their own position.
    mask = masks.make_cache_mask(jnp.asarray(3), 2, 6)
    assert mask.shape == (1, 1, 2, 6) and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask[0, 0], [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
    # A prompt prefilled in one call (positions 0-3): its prefix (0-2) attends both ways.
    prefixed = masks.make_cache_mask(0, 4, 6, jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]]))
    assert prefixed.shape == (2, 1, 4, 6)
    np.testing.assert_array_equal(prefixed[0, 0], [[1, 1, 1, 0, 0, 0],
                                                   [1, 1, 1, 0, 0, 0],
                                                   [1, 1, 1, 0, 0, 0],
                                                   [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(prefixed[1, 0], np.tril(np.ones((4, 6), bool)))


def test_make_cache_mask_equals_the_rows_of_the_full_mask():
    """Decoding the prompt in one call and the rest one position at a time sees what the
    full prefix-LM mask of the row shows at those positions."""
    length = 7
    prompt = 3
    in_prefix = np.arange(length) < prompt
    full = np.asarray(masks.make_decoder_mask(jnp.ones((1, length), jnp.int32),
                                              jnp.asarray(in_prefix[None])))[0, 0]
    first = masks.make_cache_mask(0, prompt, length, jnp.ones((1, prompt), bool))
    np.testing.assert_array_equal(first[0, 0], full[:prompt])
    for index in range(prompt, length):
        step = masks.make_cache_mask(jnp.asarray(index), 1, length)
        np.testing.assert_array_equal(step[0, 0, 0], full[index])


def test_combine_masks():
    a = jnp.asarray(np_causal(4))
    b = jnp.asarray(np.array([[1, 1, 0, 1], [1, 0, 1, 1]], bool))[:, None, None, :]
    assert masks.combine_masks() is None
    assert masks.combine_masks(None, None) is None
    assert masks.combine_masks(None, a) is a
    combined = masks.combine_masks(a, None, b)
    assert combined.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(combined, np.asarray(a) & np.asarray(b))


# --------------------------------------------------------------------------- the formula


FORMULA_BIAS = jnp.asarray(np.random.default_rng(1).normal(size=(B, N, T, S)), jnp.float32)


@functools.cache
def formula_results():
    """Every (mask, bias) case in one compilation: {(mask_name, with_bias): out}."""
    masks = {name: mask_case(name) for name in MASK_NAMES}

    @jax.jit
    def run(q, k, v, bias, masks):
        return {(name, with_bias): attention.dot_product_attention(
                    q, k, v, mask=mask, bias=bias if with_bias else None)
                for name, mask in masks.items() for with_bias in (False, True)}

    return run(*qkv(0), FORMULA_BIAS, masks)


@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_xla_matches_numpy_formula(mask_name, with_bias):
    q, k, v = qkv(0)
    out = formula_results()[mask_name, with_bias]
    assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
    expected = reference_attention(q, k, v, mask_case(mask_name),
                                   FORMULA_BIAS if with_bias else None)
    np.testing.assert_allclose(out, expected, atol=2e-6, rtol=1e-5)


def test_xla_matches_numpy_formula_cross_attention_gqa_and_value_dim():
    # T != S, K < N, Hv != H, explicit scale, padding mask [B, 1, T, S].
    q, k, v = qkv(2, t=3, s=7, kh=2, hv=5)
    mask = masks.make_padding_mask(jnp.ones((B, 3), bool),
                                   jnp.asarray(np.arange(7)[None] < np.array([[4], [7]])))
    out = attention.dot_product_attention(q, k, v, mask=mask, scale=0.3)
    assert out.shape == (B, 3, N, 5)
    np.testing.assert_allclose(out, reference_attention(q, k, v, mask, scale=0.3), atol=2e-6,
                               rtol=1e-5)
    # The scale matters: the default 1/sqrt(H) gives other numbers.
    default = attention.dot_product_attention(q, k, v, mask=mask)
    assert np.abs(np.asarray(default) - np.asarray(out)).max() > 1e-2


JAX_NN_MASKS = ["causal", "padding", "segment", "per_head"]


@functools.cache
def jax_nn_results(kv_heads):
    """{mask_name: (ours, jax.nn's)} for all masks in one compilation."""
    q, k, v = qkv(3, kh=kv_heads)
    bias = jnp.asarray(np.random.default_rng(4).normal(size=(1, N, T, S)), jnp.float32)

    @jax.jit
    def run(q, k, v, bias, masks):
        return {name: (attention.dot_product_attention(q, k, v, mask=mask, bias=bias),
                       jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask,
                                                    implementation="xla"))
                for name, mask in masks.items()}

    return run(q, k, v, bias, {name: mask_case(name) for name in JAX_NN_MASKS})


@pytest.mark.parametrize("mask_name", JAX_NN_MASKS)
@pytest.mark.parametrize("kv_heads", [N, 2])
def test_matches_jax_nn_on_rows_that_are_not_fully_masked(mask_name, kv_heads):
    ours, theirs = jax_nn_results(kv_heads)[mask_name]
    row_has_key = np.broadcast_to(np.asarray(mask_case(mask_name)), (B, N, T, S)).any(-1)
    row_has_key = row_has_key.transpose(0, 2, 1)  # [B, T, N] like the outputs
    if mask_name in ("padding", "segment"):
        assert not row_has_key.all()  # the comparison skips some rows, checked below
    np.testing.assert_allclose(np.asarray(ours)[row_has_key], np.asarray(theirs)[row_has_key],
                               atol=2e-6, rtol=1e-5)
    # Fully masked rows: zeros here (jax.nn returns the mean of V there).
    np.testing.assert_array_equal(np.asarray(ours)[~row_has_key], 0.0)


@pytest.mark.parametrize("kv_heads", [N, 2, 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("queries", [1, 3])
def test_cache_attention_matches_jax_nn(kv_heads, dtype, queries):
    """Attention over a head-major cache (k, v [B, K, S, H]): the numbers of jax.nn over the same
    keys in [B, S, K, H], masked per head or not, for a decoding step (T = 1) and a prefill;
    a query with no key to attend to gives zeros."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(B, queries, N, H)), dtype)
    k = jnp.asarray(rng.normal(size=(B, S, kv_heads, H)), dtype)
    v = jnp.asarray(rng.normal(size=(B, S, kv_heads, H)), dtype)
    mask = jnp.asarray(rng.random((B, N, queries, S)) > 0.3).at[..., 0].set(True)
    # bfloat16 (statistics and products accumulate in float32): the weights rounded to
    # bfloat16 move an output by 2^-8 x sum p |v| <= 2^-8 max|v|, and rounding the output by
    # 2^-8 |out| <= 2^-8 max|v|. So 2^-7 max|v| (~3e-2; was 2e-2, 2.3x over the 8.7e-3 seen).
    tolerance = (dict(atol=2e-6, rtol=1e-5) if dtype == jnp.float32
                 else dict(atol=2.0 ** -7 * float(jnp.abs(v.astype(jnp.float32)).max())))
    heads_first = jax.jit(attention.cache_attention)
    for m in (None, mask):
        ours = heads_first(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask=m)
        theirs = jax.nn.dot_product_attention(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask=m)
        assert ours.dtype == dtype and ours.shape == (B, queries, N, H)
        np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs),
                                   **tolerance)
    nothing = mask.at[:, :, 0].set(False)  # the first query of every head sees no key
    ours = heads_first(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask=nothing)
    np.testing.assert_array_equal(np.asarray(ours[:, 0], np.float32), 0.0)


@pytest.mark.parametrize("queries", [1, 3])
def test_cache_attention_of_beams_sharing_a_row_equals_copies_per_beam(queries):
    """q with W = 3 rows per cache row (a sentence's beams, adjacent) over one copy of its keys
    and values: the numbers of each beam over its own copy, with a mask of the source's
    padding."""
    rng = np.random.default_rng(4)
    beams = 3
    q = jnp.asarray(rng.normal(size=(B * beams, queries, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, 2, S, H)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((B, 1, 1, S)) > 0.3).at[..., 0].set(True)
    shared = jax.jit(attention.cache_attention)(q, k, v, mask=mask)
    k_copies, v_copies, mask_copies = (jnp.repeat(x, beams, axis=0) for x in (k, v, mask))
    copies = jax.jit(attention.cache_attention)(q, k_copies, v_copies, mask=mask_copies)
    assert shared.shape == (B * beams, queries, N, H)
    np.testing.assert_allclose(np.asarray(shared), np.asarray(copies), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_gqa_and_mqa_equal_mha_with_repeated_kv(implementation, kv_heads):
    q, k, v = qkv(5, kh=kv_heads)
    mask = mask_case("per_head")  # per-head mask: checks the head grouping of masks too
    bias = jnp.asarray(np.random.default_rng(6).normal(size=(B, N, T, S)), jnp.float32)
    group = N // kv_heads
    k_rep = jnp.repeat(k, group, axis=2)
    v_rep = jnp.repeat(v, group, axis=2)
    out = attend(q, k, v, mask, bias, implementation=implementation)
    expected = attend(q, k_rep, v_rep, mask, bias, implementation=implementation)
    # grouped against repeated heads: XLA may order the sums differently, so the file's float32
    # bound (top). Was 1e-6 each, 3x over the 3.5e-7 seen
    np.testing.assert_allclose(out, expected, atol=2e-6, rtol=1e-5)
    # Query head n uses kv head n // group: the last query head does not use kv head 0.
    if kv_heads > 1:
        np.testing.assert_allclose(out, reference_attention(q, k, v, mask, bias), atol=2e-6,
                                   rtol=1e-5)
        k_wrong = jnp.tile(k, (1, 1, group, 1))  # head n -> kv head n % K: the wrong grouping
        v_wrong = jnp.tile(v, (1, 1, group, 1))
        wrong = attend(q, k_wrong, v_wrong, mask, bias, implementation=implementation)
        assert np.abs(np.asarray(wrong) - np.asarray(out)).max() > 1e-2


# --------------------------------------------------------------------------- chunked == xla


@functools.partial(jax.jit, static_argnames="key_chunk_size")
def _values_and_grads(q, k, v, bias, mask, cotangent, key_chunk_size):
    """{implementation: (out, (dq, dk, dv, dbias))} of sum(out * cotangent)."""

    def loss(implementation, q, k, v, bias):
        out = attention.dot_product_attention(q, k, v, mask=mask, bias=bias,
                                              implementation=implementation,
                                              key_chunk_size=key_chunk_size)
        return jnp.sum(out * cotangent), out

    results = {}
    for implementation in ("xla", "chunked"):
        grad_fn = jax.value_and_grad(functools.partial(loss, implementation),
                                     argnums=(0, 1, 2, 3), has_aux=True)
        (_, out), grads = grad_fn(q, k, v, bias)
        results[implementation] = (out, grads)
    return results


CHUNKED_CASES = {
    # name: (t, s, n, kh, hv, key_chunk_size, mask shape or None, bias shape)
    "mask_1_1_T_S": (5, 11, 2, 2, 8, 4, (1, 1, 5, 11), (B, 2, 5, 11)),
    "mask_B_1_T_S_gqa_bias_over_S": (5, 11, 4, 2, 8, 4, (B, 1, 5, 11), (B, 4, 5, 1)),
    "mask_B_N_T_S_mqa_hv": (6, 10, 4, 1, 6, 3, (B, 4, 6, 10), (1, 4, 6, 10)),
    "no_mask_whole_blocks_bias_B_1_1_S": (5, 12, 4, 2, 8, 4, None, (B, 1, 1, 12)),
    "one_block_bias_over_S": (4, 7, 2, 1, 8, 16, (B, 1, 4, 7), (B, 2, 4, 1)),
}


@pytest.mark.parametrize("case", list(CHUNKED_CASES))
def test_chunked_equals_xla_in_value_and_gradient(case):
    t, s, n, kh, hv, chunk, mask_shape, bias_shape = CHUNKED_CASES[case]
    rng = np.random.default_rng(8)
    q, k, v = qkv(9, t=t, s=s, n=n, kh=kh, hv=hv)
    mask = None
    if mask_shape is not None:
        mask = rng.random(mask_shape) < 0.7
        mask[..., 0, :] = False  # one fully masked query row
        mask = jnp.asarray(mask)
    bias = jnp.asarray(rng.normal(size=bias_shape), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(B, t, n, hv)), jnp.float32)
    results = _values_and_grads(q, k, v, bias, mask, cotangent, key_chunk_size=chunk)
    (out_x, grads_x), (out_c, grads_c) = results["xla"], results["chunked"]
    np.testing.assert_allclose(out_c, out_x, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out_x, reference_attention(q, k, v, mask, bias), atol=1e-5,
                               rtol=1e-5)
    for name, g_c, g_x, primal in zip("q k v bias".split(), grads_c, grads_x, (q, k, v, bias),
                                      strict=True):
        assert g_c.shape == primal.shape and g_c.dtype == primal.dtype, name
        np.testing.assert_allclose(g_c, g_x, atol=2e-5, rtol=1e-4, err_msg=name)
    # The gradients are not trivially zero (except the bias constant over keys, which the
    # softmax ignores).
    for g in grads_x[:3]:
        assert np.abs(np.asarray(g)).max() > 1e-2
    if bias_shape[-1] == 1:
        np.testing.assert_allclose(grads_x[3], 0.0, atol=1e-5)
    else:
        assert np.abs(np.asarray(grads_x[3])).max() > 1e-2


def test_chunked_gradient_matches_finite_differences():
    q, k, v = qkv(10, t=4, s=9, kh=2)
    rng = np.random.default_rng(11)
    bias = jnp.asarray(rng.normal(size=(1, N, 4, 9)), jnp.float32)
    mask = jnp.asarray(rng.random((B, 1, 4, 9)) < 0.8)
    cot = jnp.asarray(rng.normal(size=(B, 4, N, H)), jnp.float32)

    def f(q, k, v, bias):
        out = attention.dot_product_attention(q, k, v, mask=mask, bias=bias,
                                              implementation="chunked", key_chunk_size=4)
        return jnp.sum(out * cot)

    primals = (q, k, v, bias)
    directions = [jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in primals]
    eps = 1e-2

    @jax.jit
    def analytic_and_numeric(primals, directions):
        grads = jax.grad(f, argnums=(0, 1, 2, 3))(*primals)
        analytic = sum(jnp.sum(g * d) for g, d in zip(grads, directions, strict=True))
        plus = f(*[x + eps * d for x, d in zip(primals, directions, strict=True)])
        minus = f(*[x - eps * d for x, d in zip(primals, directions, strict=True)])
        return analytic, (plus - minus) / (2 * eps)

    analytic, numeric = analytic_and_numeric(primals, directions)
    np.testing.assert_allclose(analytic, numeric, rtol=2e-3)


# --------------------------------------------------------------------------- fully masked rows


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_fully_masked_row_gives_zeros_and_finite_gradients(implementation):
    q, k, v = qkv(12, s=7)
    mask = np.ones((B, 1, T, 7), bool)
    mask[0, 0, 2] = False  # batch 0, query 2 attends to nothing
    mask[1, 0, :, 3:] = False
    mask = jnp.asarray(mask)
    bias = jnp.asarray(np.random.default_rng(13).normal(size=(B, N, T, 7)), jnp.float32)

    def loss(q, k, v, bias):
        out = attention.dot_product_attention(q, k, v, mask=mask, bias=bias,
                                              implementation=implementation, key_chunk_size=3)
        return jnp.sum(out**2), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, bias)
    out = np.asarray(out)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[0, 2], 0.0)
    assert np.abs(out[0, 1]).min() > 0 and np.abs(out[0, 3]).min() > 0
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(grads[0][0, 2], 0.0)  # no gradient into the masked query
    np.testing.assert_array_equal(grads[3][0, :, 2], 0.0)  # nor its bias row
    # Keys masked for every query get no gradient.
    np.testing.assert_array_equal(grads[1][1, 3:], 0.0)
    np.testing.assert_array_equal(grads[2][1, 3:], 0.0)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_all_rows_masked_gives_zeros(implementation):
    q, k, v = qkv(14)
    out = attend(q, k, v, jnp.zeros((1, 1, T, S), bool), implementation=implementation)
    np.testing.assert_array_equal(out, 0.0)


# --------------------------------------------------------------------------- dtypes


def test_attention_weights_float32_rows_sum_to_one():
    q, k, _ = qkv(15, kh=2, dtype=jnp.bfloat16)
    mask = mask_case("causal+padding")
    weights = attention.attention_weights(q, k, mask=mask)
    assert weights.shape == (B, N, T, S) and weights.dtype == jnp.float32
    sums = np.asarray(weights).sum(-1)
    row_has_key = np.broadcast_to(np.asarray(mask), (B, N, T, S)).any(-1)
    np.testing.assert_allclose(sums[row_has_key], 1.0, atol=1e-6)
    np.testing.assert_array_equal(sums[~row_has_key], 0.0)
    np.testing.assert_array_equal(np.asarray(weights)[~np.broadcast_to(mask, weights.shape)], 0)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_bfloat16_inputs_softmax_in_float32(implementation):
    """Logits near 144 that differ by ~1: bf16 rounds them by up to 0.5, which a bf16 softmax
    would turn into errors of order 0.1; float32 logits and softmax leave only the bf16
    rounding of the weights and the output (~1e-3)."""
    rng = np.random.default_rng(16)
    t = 8
    s = 16
    h = 16
    q = jnp.asarray(6.0 + 0.1 * rng.normal(size=(B, t, N, h)), jnp.bfloat16)
    k = jnp.asarray(6.0 + 0.1 * rng.normal(size=(B, s, N, h)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(B, s, N, h)), jnp.bfloat16)
    out = attend(q, k, v, implementation=implementation)
    assert out.dtype == jnp.bfloat16 and out.shape == (B, t, N, h)
    expected = reference_attention(q, k, v)  # float64 on the same bf16-rounded inputs
    error = np.abs(np.asarray(out, np.float64) - expected).max()

    # What rounding the logits to bf16 (a softmax in bf16) would do to the same inputs.
    logits = np.einsum("BTNH,BSNH->BNTS", *(np.asarray(x, np.float64) for x in (q, k))) / 4
    logits_bf16 = np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float64)
    weights = np.exp(logits_bf16 - logits_bf16.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    bf16_softmax = np.einsum("BNTS,BSNE->BTNE", weights, np.asarray(v, np.float64))
    bf16_error = np.abs(bf16_softmax - expected).max()

    assert error < 0.02 < bf16_error, (error, bf16_error)


# --------------------------------------------------------------------------- dropout


def test_dropout_rate_zero_is_identity():
    q, k, v = qkv(17)
    mask = mask_case("causal")
    plain = attention.dot_product_attention(q, k, v, mask=mask)
    with_rng = attention.dot_product_attention(q, k, v, mask=mask, dropout_rate=0.0,
                                               dropout_rng=jax.random.key(0))
    np.testing.assert_array_equal(with_rng, plain)


@jax.jit
def _dropout_weights(rng):
    """With q = 0 the weights are uniform (1/S); v = I makes the output the dropped weights."""
    s = 64
    q = jnp.zeros((1, 8, 4, 16))
    k = jnp.asarray(np.random.default_rng(18).normal(size=(1, s, 1, 16)), jnp.float32)
    v = jnp.eye(s)[None, :, None, :]
    return attention.dot_product_attention(q, k, v, dropout_rate=0.25, dropout_rng=rng)


def test_attention_dropout_statistics_and_reproducibility():
    out = np.asarray(_dropout_weights(jax.random.key(1)))  # [1, T, N, S]: dropped weights
    kept = out != 0
    assert abs(kept.mean() - 0.75) < 0.05
    np.testing.assert_allclose(out[kept], (1 / 64) / 0.75, rtol=1e-6)  # inverted dropout
    row_sums = out.sum(-1)
    assert abs(row_sums.mean() - 1.0) < 0.05  # the mean over keys is preserved
    assert row_sums.std() > 0.01  # but single rows are not
    np.testing.assert_array_equal(_dropout_weights(jax.random.key(1)), out)
    assert (np.asarray(_dropout_weights(jax.random.key(2))) != out).any()


def test_dropout_needs_rng():
    q, k, v = qkv(19)
    with pytest.raises(ValueError, match="rng"):
        attention.dot_product_attention(q, k, v, dropout_rate=0.1)


@pytest.mark.parametrize("implementation", ["chunked", "cudnn"])
def test_dropout_unsupported_by_chunked_and_cudnn(implementation):
    q, k, v = qkv(20)
    with pytest.raises(ValueError, match=implementation):
        attention.dot_product_attention(q, k, v, dropout_rate=0.1,
                                        dropout_rng=jax.random.key(0),
                                        implementation=implementation)


def test_cudnn_off_gpu_raises():
    if jax.default_backend() == "gpu":
        pytest.skip("cuDNN runs here")
    q, k, v = qkv(21)
    with pytest.raises(ValueError, match="cudnn"):
        attention.dot_product_attention(q, k, v, implementation="cudnn")


@pytest.mark.parametrize("mask_name", ["none", "causal", "padding", "per_head"])
def test_cudnn_wrapper_masks_like_xla(monkeypatch, mask_name):
    """The cuDNN path's own code (masks, zeros on fully masked rows) run on CPU, with jax.nn's
    "xla" implementation standing in for cuDNN."""
    real = jax.nn.dot_product_attention

    def stand_in(*args, implementation=None, **kwargs):
        assert implementation == "cudnn"
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)
    q, k, v = qkv(24, kh=2)
    mask = mask_case(mask_name)
    out = attention.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
    np.testing.assert_allclose(out, reference_attention(q, k, v, mask), atol=2e-6, rtol=1e-5)


def _strict_cudnn_stand_in(monkeypatch):
    """jax.nn's "xla" attention standing in for cuDNN on CPU, refusing what jax's cuDNN path
    refuses: odd lengths with a mask or bias (`check_is_flash_attention`, for the backward), a
    mask or bias not spanning T and S whole (`check_layout`)."""
    real = jax.nn.dot_product_attention

    def stand_in(q, k, v, bias=None, mask=None, *, implementation=None, **kwargs):
        assert implementation == "cudnn"
        if (bias is not None or mask is not None) and (q.shape[1] % 2 or k.shape[1] % 2):
            raise NotImplementedError(f"Unsupported sequence length Q {q.shape[1]}, "
                                      f"KV {k.shape[1]}.")
        for x in (bias, mask):
            if x is not None and x.shape[2:] != (q.shape[1], k.shape[1]):
                raise ValueError(f"Bias must have same seq length as QKV, got "
                                 f"{x.shape[2]} and {x.shape[3]}")
        return real(q, k, v, bias, mask, implementation="xla", **kwargs)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)


@pytest.mark.parametrize("t, s", [(7, 7), (7, 6), (6, 5), (1, 5), (6, 4)])
@pytest.mark.parametrize("masking", ["padding", "causal", "bias", "bias+per_head"])
def test_cudnn_wrapper_takes_odd_lengths_and_broadcast_masks(monkeypatch, t, s, masking):
    """A 255-token source (a batch of 256-token rows) with its [B, 1, 1, S] padding mask: jax's
    cuDNN path refuses odd lengths with a mask or bias and a mask not spanning T and S, so the
    wrapper pads T and S to even and broadcasts. Outputs and gradients equal the float64
    formula, fully masked rows zero."""
    _strict_cudnn_stand_in(monkeypatch)
    q, k, v = qkv(26, t=t, s=s, kh=2)
    rng = np.random.default_rng(3)
    kv_valid = np.arange(s)[None] < np.array([[s], [s - 2]])
    mask = jnp.asarray(kv_valid[:, None, None, :])  # [B, 1, 1, S]
    bias = None
    if masking == "causal":
        mask = jnp.asarray(np.tril(np.ones((t, s), bool), k=s - t)[None, None])
    if masking.startswith("bias"):
        bias = jnp.asarray(rng.normal(size=(1, N, t, s)), jnp.float32)
        mask = (jnp.asarray(rng.random((B, N, t, s)) < 0.6) if masking == "bias+per_head"
                else None)
    weights = jnp.asarray(rng.normal(size=(B, t, N, H)), jnp.float32)

    def loss(implementation, q, k, v):
        out = attention.dot_product_attention(q, k, v, mask=mask, bias=bias,
                                              implementation=implementation)
        return jnp.sum(out * weights), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(
        "cudnn", q, k, v)
    assert out.shape == (B, t, N, H)
    np.testing.assert_allclose(out, reference_attention(q, k, v, mask, bias), atol=2e-6,
                               rtol=1e-5)
    (_, _), expected = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)("xla", q, k, v)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_cudnn_matches_xla_on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("cuDNN needs an NVIDIA GPU")
    for t in (128, 255):  # 255: a 256-token row's source, odd (padded to even for cuDNN)
        q, k, v = qkv(25, t=t, s=t, kh=2, h=64, dtype=jnp.bfloat16)
        valid = jnp.asarray(np.arange(t)[None] < np.array([[t], [100]]))
        mask = masks.combine_masks(masks.make_causal_mask(t),
                                   masks.make_padding_mask(valid, valid))
        out = attend(q, k, v, mask, implementation="cudnn")
        expected = attend(q, k, v, mask, implementation="xla")
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out, np.float32),
                                   np.asarray(expected, np.float32), atol=2e-2, rtol=2e-2)
        grads = [jax.grad(lambda q, k, v, mask=mask, impl=impl: jnp.sum(
            attend(q, k, v, mask, implementation=impl).astype(jnp.float32) ** 2),
            argnums=(0, 1, 2))(q, k, v) for impl in ("cudnn", "xla")]
        for got, want in zip(*grads, strict=True):
            np.testing.assert_allclose(np.asarray(got, np.float32),
                                       np.asarray(want, np.float32), atol=6e-2, rtol=6e-2)


class _FakeDevice:
    platform = "gpu"
    device_kind = "NVIDIA H200"

    def __init__(self, capability):
        self.compute_capability = capability


@pytest.mark.parametrize("capability, dtype, h, s, dropout, expected", [
    (None, jnp.float32, 64, 128, 0.0, "xla"),  # this CPU
    (None, jnp.bfloat16, 64, 4096, 0.0, "chunked"),  # long: linear memory
    (None, jnp.float32, 64, 4096, 0.1, "xla"),  # only xla has attention dropout
    ("9.0", jnp.bfloat16, 64, 128, 0.0, "cudnn"),  # Hopper, bf16
    ("8.0", jnp.float16, 128, 4096, 0.0, "cudnn"),  # Ampere, fp16, long
    ("9.0", jnp.float32, 64, 128, 0.0, "xla"),  # cuDNN flash needs 16-bit inputs
    ("9.0", jnp.bfloat16, 256, 128, 0.0, "xla"),  # head dim over 128
    ("9.0", jnp.bfloat16, 64, 8192, 0.1, "xla"),  # dropout
    ("7.0", jnp.bfloat16, 64, 128, 0.0, "xla"),  # V100: no cuDNN flash attention
])
def test_auto_picks_by_device_dtype_and_length(monkeypatch, capability, dtype, h, s, dropout,
                                               expected):
    if capability is not None:
        monkeypatch.setattr(jax, "devices", lambda *a: [_FakeDevice(capability)])
    elif jax.default_backend() == "gpu":
        pytest.skip("the CPU cases")
    q, k, v = (jax.ShapeDtypeStruct(shape, dtype)
               for shape in ((1, 4, 2, h), (1, s, 2, h), (1, s, 2, h)))
    assert attention.choose_implementation(q, k, v, dropout_rate=dropout) == expected


@pytest.mark.parametrize("s", [6, 4096])
def test_auto_gives_the_same_numbers_as_xla(s):
    q, k, v = qkv(26, t=3, s=s, n=2, kh=1, h=8)
    valid = jnp.asarray(np.arange(s)[None] < np.array([[s], [s - 2]]))
    mask = masks.make_padding_mask(jnp.ones((B, 3), bool), valid)
    out = attend(q, k, v, mask, implementation="auto", key_chunk_size=512)
    np.testing.assert_allclose(out, reference_attention(q, k, v, mask), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(out, attend(q, k, v, mask), atol=2e-6, rtol=1e-5)


def test_unknown_implementation_and_bad_ranks_raise():
    q, k, v = qkv(22)
    with pytest.raises(ValueError, match="'flash'"):
        attention.dot_product_attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="B,T,N,H"):
        attention.dot_product_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention.dot_product_attention(q, k[:, :, :3], v[:, :, :3])


# --------------------------------------------------------------------------- transformations


def test_jit_grad_and_vmap_over_extra_leading_axis():
    e = 3
    q, k, v = (x.reshape((e, B) + x.shape[1:]) for x in qkv(23, b=e * B, kh=2, s=7))
    mask = masks.make_padding_mask(jnp.ones((B, T), bool),
                                   jnp.asarray(np.arange(7)[None] < np.array([[5], [7]])))

    def value_and_grads(implementation, q, k, v):
        def f(q, k, v):
            return attention.dot_product_attention(q, k, v, mask=mask,
                                                   implementation=implementation,
                                                   key_chunk_size=3)

        return f(q, k, v), jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))(q, k, v)

    @jax.jit
    def both(q, k, v):
        return {impl: jax.vmap(functools.partial(value_and_grads, impl))(q, k, v)
                for impl in ("xla", "chunked")}

    results = both(q, k, v)
    (out_x, grads_x), (out_c, grads_c) = results["xla"], results["chunked"]
    assert out_x.shape == out_c.shape == (e, B, T, N, H)
    for i in range(e):
        expected = reference_attention(q[i], k[i], v[i], mask)
        np.testing.assert_allclose(out_x[i], expected, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(out_c[i], expected, atol=1e-5, rtol=1e-5)
    for g_x, g_c in zip(grads_x, grads_c, strict=True):
        np.testing.assert_allclose(g_c, g_x, atol=2e-5, rtol=1e-4)
        assert np.abs(np.asarray(g_x)).max() > 1e-2
    # The batched gradient is the per-slice gradient (slice 1 alone, unbatched).
    grads_1 = jax.jit(functools.partial(value_and_grads, "chunked"))(q[1], k[1], v[1])[1]
    for g, g1 in zip(grads_c, grads_1, strict=True):
        np.testing.assert_allclose(g[1], g1, atol=1e-5, rtol=1e-5)
