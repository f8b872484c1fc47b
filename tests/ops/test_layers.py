"""Tests of transformer.ops.layers: positional encodings, norms, the feed-forward network and
dropout, against numpy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.ops import layers

pytestmark = pytest.mark.usefixtures("strict_dtype_promotion")


# --------------------------------------------------------------------------- sinusoidal


def paper_pe(length, d_model):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    pe = np.zeros((length, d_model))
    for pos in range(length):
        for j in range(d_model):
            two_i = j - j % 2
            angle = pos / 10000 ** (two_i / d_model)
            pe[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    return pe


@pytest.mark.parametrize("length,d_model", [(50, 16), (7, 6), (5, 7)])
def test_sinusoidal_matches_paper_formula(length, d_model):
    pe = jax.jit(layers.sinusoidal_position_encoding, static_argnums=(0, 1))(length, d_model)
    assert pe.shape == (length, d_model) and pe.dtype == jnp.float32
    np.testing.assert_allclose(pe, paper_pe(length, d_model), atol=2e-5)
    # Interleaved: position 0 is sin(0)=0 at even, cos(0)=1 at odd indices.
    np.testing.assert_array_equal(pe[0, 0::2], 0.0)
    np.testing.assert_array_equal(pe[0, 1::2], 1.0)


def test_sinusoidal_pe_pos_plus_k_is_a_rotation_of_pe_pos():
    """For each frequency w_i, [PE(p+k, 2i), PE(p+k, 2i+1)] = R(k w_i) [PE(p, 2i), PE(p, 2i+1)]
    with R depending only on k (the paper's reason for choosing sinusoids)."""
    d_model = 16
    length = 64
    pe = jax.jit(layers.sinusoidal_position_encoding, static_argnums=(0, 1))(length, d_model)
    pe = np.asarray(pe, np.float64)
    pairs = pe.reshape(length, d_model // 2, 2)  # [pos, i, (sin, cos)]
    freqs = 1.0 / 10000 ** (np.arange(0, d_model, 2) / d_model)
    for k in (1, 5, 17):
        c = np.cos(k * freqs)
        s = np.sin(k * freqs)
        rotation = np.stack([np.stack([c, s], -1), np.stack([-s, c], -1)], -2)  # [i, 2, 2]
        predicted = np.einsum("iab,pib->pia", rotation, pairs[: length - k])
        np.testing.assert_allclose(predicted, pairs[k:], atol=1e-4)
        # Least squares from the data alone finds the same map for every position.
        for i in (0, 3, 7):
            fitted, *_ = np.linalg.lstsq(pairs[: length - k, i], pairs[k:, i], rcond=None)
            np.testing.assert_allclose(fitted.T, rotation[i], atol=1e-4)


# --------------------------------------------------------------------------- RoPE


def test_rope_hand_case_half_split_pairs():
    """H=4: pairs (0, 2) rotate by p * 1 and (1, 3) by p * 10000^(-2/4) = p / 100."""
    a = 0.3
    b = -1.2
    c = 0.7
    d = 2.0
    p = 3.0
    x = jnp.asarray([a, b, c, d], jnp.float32).reshape(1, 1, 1, 4)
    out = np.asarray(layers.apply_rope(x, jnp.asarray([[p]])))[0, 0, 0]
    t0 = p * 1.0
    t1 = p / 100.0
    expected = [a * math.cos(t0) - c * math.sin(t0),
                b * math.cos(t1) - d * math.sin(t1),
                c * math.cos(t0) + a * math.sin(t0),
                d * math.cos(t1) + b * math.sin(t1)]
    np.testing.assert_allclose(out, expected, atol=1e-6)
    # Not the interleaved convention, which pairs (0, 1) and (2, 3).
    interleaved = [a * math.cos(t0) - b * math.sin(t0), b * math.cos(t0) + a * math.sin(t0)]
    assert np.abs(out[:2] - interleaved).max() > 0.1


def _rope_dot(q, k, m, n):
    """q . k after rotating q to position m and k to position n, per (m, n) pair."""
    pos_q = jnp.asarray(m, jnp.int32)[:, None]
    pos_k = jnp.asarray(n, jnp.int32)[:, None]
    return np.asarray(_rope_dot_jit(q, k, pos_q, pos_k))[:, 0, 0]


@jax.jit
def _rope_dot_jit(q, k, pos_q, pos_k):
    b = pos_q.shape[0]
    qr = layers.apply_rope(jnp.broadcast_to(q, (b, 1, 1, q.shape[-1])), pos_q)
    kr = layers.apply_rope(jnp.broadcast_to(k, (b, 1, 1, k.shape[-1])), pos_k)
    return jnp.sum(qr * kr, axis=-1)


def test_rope_dot_product_depends_only_on_relative_position():
    rng = np.random.default_rng(0)
    h = 16
    q = jnp.asarray(rng.normal(size=h), jnp.float32)
    k = jnp.asarray(rng.normal(size=h), jnp.float32)
    m = np.array([0, 3, 10, 7, 2, 40])
    n = np.array([0, 5, 4, 7, 9, 33])
    c = 11
    dots = _rope_dot(q, k, m, n)
    shifted = _rope_dot(q, k, m + c, n + c)
    np.testing.assert_allclose(shifted, dots, atol=1e-4)
    # Same offset m - n gives the same value; a different offset another value.
    np.testing.assert_allclose(dots[0], dots[3], atol=1e-5)  # m - n = 0 both
    assert abs(dots[1] - dots[2]) > 1e-2  # -2 vs +6
    np.testing.assert_allclose(dots[0], float(jnp.dot(q, k)), rtol=1e-6)


def test_rope_preserves_norm_and_position_zero_is_identity():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 5, 3, 8)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 100, size=(2, 5)))
    rope = jax.jit(layers.apply_rope)
    out = rope(x, positions)
    assert out.shape == x.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    assert np.abs(np.asarray(out - x)).max() > 0.1
    np.testing.assert_array_equal(rope(x, jnp.zeros((2, 5), jnp.int32)), x)


def test_rope_dtype_and_odd_head_dim():
    x = jnp.ones((1, 2, 1, 4), jnp.bfloat16)
    assert layers.apply_rope(x, jnp.asarray([[0, 1]])).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="even head dim"):
        layers.apply_rope(jnp.ones((1, 2, 1, 5)), jnp.asarray([[0, 1]]))


# --------------------------------------------------------------------------- norms


def np_layer_norm(x, scale, bias, eps=1e-6):
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * scale
    return y if bias is None else y + bias


def np_rms_norm(x, scale, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


@pytest.fixture
def norm_inputs():
    rng = np.random.default_rng(2)
    x = (3.0 + 2.0 * rng.normal(size=(2, 3, 16))).astype(np.float32)
    scale = (1.0 + 0.5 * rng.normal(size=16)).astype(np.float32)
    bias = rng.normal(size=16).astype(np.float32)
    return x, scale, bias


def test_layer_norm_matches_numpy(norm_inputs):
    x, scale, bias = norm_inputs
    out = layers.layer_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, np_layer_norm(x, scale, bias), atol=1e-5, rtol=1e-5)
    no_bias = layers.layer_norm(jnp.asarray(x), jnp.asarray(scale))
    np.testing.assert_allclose(no_bias, np_layer_norm(x, scale, None), atol=1e-5, rtol=1e-5)
    eps = layers.layer_norm(jnp.asarray(x), jnp.asarray(scale), eps=10.0)
    np.testing.assert_allclose(eps, np_layer_norm(x, scale, None, eps=10.0), atol=1e-5,
                               rtol=1e-5)


def test_rms_norm_matches_numpy(norm_inputs):
    x, scale, _ = norm_inputs
    out = layers.rms_norm(jnp.asarray(x), jnp.asarray(scale))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, np_rms_norm(x, scale), atol=1e-5, rtol=1e-5)
    # Unlike LayerNorm, the mean is not removed.
    assert np.abs(np_rms_norm(x, scale) - np_layer_norm(x, scale, None)).max() > 0.1


def test_norms_bfloat16_in_bfloat16_out(norm_inputs):
    x, scale, bias = norm_inputs
    x16 = jnp.asarray(x, jnp.bfloat16)
    x_rounded = np.asarray(x16, np.float64)
    ln = layers.layer_norm(x16, jnp.asarray(scale), jnp.asarray(bias))
    rms = layers.rms_norm(x16, jnp.asarray(scale))
    assert ln.dtype == jnp.bfloat16 and rms.dtype == jnp.bfloat16
    # Statistics in float32: only the output is rounded to bf16 (relative 2^-8 = 3.9e-3):
    # rtol twice that; atol a bf16 step at the outputs' size (~2), for scale x n + bias
    # rounded once more where a sum cancels (seen: 7.7e-3 against 2.6e-2)
    np.testing.assert_allclose(np.asarray(ln, np.float64), np_layer_norm(x_rounded, scale, bias),
                               rtol=8e-3, atol=1e-2)
    np.testing.assert_allclose(np.asarray(rms, np.float64), np_rms_norm(x_rounded, scale),
                               rtol=8e-3, atol=1e-2)


# --------------------------------------------------------------------------- feed-forward


def np_gelu_tanh(x):
    """jax.nn.gelu's default (approximate=True): the tanh form of Hendrycks & Gimpel."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.fixture
def ffn_inputs():
    rng = np.random.default_rng(3)
    d = 8
    f = 12
    arrays = dict(x=rng.normal(size=(2, 3, d)), ff_in=rng.normal(size=(d, f)) / 3,
                  ff_out=rng.normal(size=(f, d)) / 3, ff_gate=rng.normal(size=(d, f)) / 3,
                  bias_in=rng.normal(size=f), bias_out=rng.normal(size=d))
    return {name: a.astype(np.float32) for name, a in arrays.items()}


def test_feed_forward_relu_matches_paper_eq2(ffn_inputs):
    a = ffn_inputs
    out = layers.feed_forward(jnp.asarray(a["x"]), jnp.asarray(a["ff_in"]),
                              jnp.asarray(a["ff_out"]), bias_in=jnp.asarray(a["bias_in"]),
                              bias_out=jnp.asarray(a["bias_out"]))
    hidden = np.maximum(0, a["x"].astype(np.float64) @ a["ff_in"] + a["bias_in"])
    assert (hidden == 0).any() and (hidden > 0).any()
    np.testing.assert_allclose(out, hidden @ a["ff_out"] + a["bias_out"], atol=1e-5, rtol=1e-5)
    no_bias = layers.feed_forward(jnp.asarray(a["x"]), jnp.asarray(a["ff_in"]),
                                  jnp.asarray(a["ff_out"]))
    np.testing.assert_allclose(
        no_bias, np.maximum(0, a["x"].astype(np.float64) @ a["ff_in"]) @ a["ff_out"],
        atol=1e-5, rtol=1e-5)


def test_feed_forward_gelu(ffn_inputs):
    a = ffn_inputs
    out = layers.feed_forward(jnp.asarray(a["x"]), jnp.asarray(a["ff_in"]),
                              jnp.asarray(a["ff_out"]), bias_in=jnp.asarray(a["bias_in"]),
                              bias_out=jnp.asarray(a["bias_out"]), activation="gelu")
    hidden = np_gelu_tanh(a["x"].astype(np.float64) @ a["ff_in"] + a["bias_in"])
    np.testing.assert_allclose(out, hidden @ a["ff_out"] + a["bias_out"], atol=1e-5, rtol=1e-5)


def test_feed_forward_swiglu(ffn_inputs):
    a = ffn_inputs
    out = layers.feed_forward(jnp.asarray(a["x"]), jnp.asarray(a["ff_in"]),
                              jnp.asarray(a["ff_out"]), ff_gate=jnp.asarray(a["ff_gate"]),
                              activation="swiglu")
    x = a["x"].astype(np.float64)
    gate = x @ a["ff_gate"]
    hidden = gate / (1 + np.exp(-gate)) * (x @ a["ff_in"])  # Swish(x W_gate) * x W1
    np.testing.assert_allclose(out, hidden @ a["ff_out"], atol=1e-5, rtol=1e-5)


def test_feed_forward_errors(ffn_inputs):
    x, w_in, w_out, gate = (jnp.asarray(ffn_inputs[k]) for k in ("x", "ff_in", "ff_out",
                                                                   "ff_gate"))
    with pytest.raises(ValueError, match="'tanh'"):
        layers.feed_forward(x, w_in, w_out, activation="tanh")
    with pytest.raises(ValueError, match="ff_gate"):
        layers.feed_forward(x, w_in, w_out, activation="swiglu")
    with pytest.raises(ValueError, match="ff_gate"):
        layers.feed_forward(x, w_in, w_out, ff_gate=gate, activation="relu")
    with pytest.raises(ValueError, match="rng"):
        layers.feed_forward(x, w_in, w_out, dropout_rate=0.1)


def test_feed_forward_relu_dropout():
    """With ff_out = I the output is the dropped hidden layer itself."""
    rng = np.random.default_rng(4)
    d = 8
    f = 64
    rate = 0.3
    x = jnp.asarray(rng.normal(size=(4, 16, d)), jnp.float32)
    ff_in = jnp.asarray(rng.normal(size=(d, f)), jnp.float32)
    eye = jnp.eye(f)
    hidden = np.asarray(jax.nn.relu(x @ ff_in))
    run = jax.jit(lambda key: layers.feed_forward(x, ff_in, eye, dropout_rate=rate,
                                                  dropout_rng=key))
    out = np.asarray(run(jax.random.key(0)))
    positive = hidden > 0
    kept = out[positive] != 0
    assert abs(kept.mean() - (1 - rate)) < 0.04
    np.testing.assert_allclose(out[positive][kept], hidden[positive][kept] / (1 - rate),
                               rtol=1e-5)
    np.testing.assert_array_equal(out[~positive], 0.0)
    np.testing.assert_array_equal(run(jax.random.key(0)), out)
    assert (np.asarray(run(jax.random.key(1))) != out).any()
    no_dropout = layers.feed_forward(x, ff_in, eye, dropout_rate=0.0,
                                     dropout_rng=jax.random.key(0))
    np.testing.assert_allclose(no_dropout, hidden, rtol=1e-6)


def test_dropout_function():
    x = jnp.ones((1000,), jnp.bfloat16)
    assert layers.dropout(x, 0.0, None) is x
    y = layers.dropout(x, 0.5, jax.random.key(0))
    assert y.dtype == jnp.bfloat16
    values = set(np.asarray(y, np.float32).tolist())
    assert values == {0.0, 2.0}
    assert abs(float((np.asarray(y, np.float32) == 0).mean()) - 0.5) < 0.06
