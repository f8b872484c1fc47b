"""optimizer.name="muon": which kernels Muon orthogonalizes, and its first update against numpy
written from Jordan et al. (2024) and Liu et al. (2025)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers

from transformer.training import moments, optim


def opt_config(**overrides) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(dict(
        name="muon", schedule="constant", learning_rate=0.01, warmup_steps=0, b1=0.9, b2=0.98,
        eps=1e-9, weight_decay=0.0, clip_norm=0.0))
    cfg.update(overrides)
    return cfg

SHAPES = {
    "embedding": {"embedding": (10, 8)},
    "encoder": {"layers_0": {
        "self_attention": {"query": {"kernel": (8, 2, 3), "bias": (2, 3)},
                           "out": {"kernel": (2, 3, 8), "bias": (8,)}},
        "ffn": {"ff_in": {"kernel": (8, 16), "bias": (16,)}, "ff_out": {"kernel": (16, 8)}},
        "norm_ffn": {"scale": (8,)}}},
    "logits": {"kernel": (8, 10)},
}


def params_of(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes,
                        is_leaf=lambda s: isinstance(s, tuple))


def test_muon_takes_the_blocks_projection_kernels_with_their_input_and_output_axes():
    dims = moments.muon_dimensions(params_of(SHAPES))
    block = dims["encoder"]["layers_0"]
    assert block["self_attention"]["query"] == {"kernel": MuonDimensionNumbers(0, (1, 2)),
                                                "bias": None}
    assert block["self_attention"]["out"] == {"kernel": MuonDimensionNumbers((0, 1), 2),
                                              "bias": None}
    assert block["ffn"]["ff_in"]["kernel"] == MuonDimensionNumbers((0,), 1)
    assert block["ffn"]["ff_out"]["kernel"] == MuonDimensionNumbers((0,), 1)
    # Embeddings, the output projection and the norms are Adam's.
    assert dims["embedding"]["embedding"] is None
    assert dims["logits"]["kernel"] is None
    assert block["norm_ffn"]["scale"] is None


def test_stacked_layers_are_batch_axes_and_boxes_are_read_through():
    stacked = {"query": {"kernel": nn.Partitioned(jnp.zeros((4, 8, 2, 3)),
                                                  ("layers", "embed", "heads", "head_dim"))},
               "out": {"kernel": jnp.zeros((4, 2, 3, 8))}}
    dims = moments.muon_dimensions(stacked)
    assert dims["query"]["kernel"] == MuonDimensionNumbers(1, (2, 3))
    assert dims["out"]["kernel"] == MuonDimensionNumbers((1, 2), 3)


def newton_schulz(g: np.ndarray) -> np.ndarray:
    """Jordan et al.'s quintic Newton-Schulz iteration, 5 steps, in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / np.linalg.norm(g)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


# float32 matmuls round each product to 2**-24 relative. One iteration's derivative is at most
# a = 3.44 in size (at small singular values), so 5 iterations amplify a rounding by at most
# 3.44**5 = 480, over sums of up to 16 terms (x4 typical growth): ~1e-4 relative to the update.
# rtol 1e-3 leaves a margin of 10.
NS_RTOL = 1e-3


@pytest.mark.parametrize("rms", [0.2, 0.5])
def test_first_update_is_newton_schulz_for_kernels_and_adam_for_the_rest(rms):
    lr = 0.01
    tx, _ = optim.make_optimizer(
        opt_config(learning_rate=lr, muon_rms=rms), d_model=8, total_steps=10)
    params = params_of(SHAPES)
    grads = params_of(SHAPES, seed=1)
    updates, _ = tx.update(grads, tx.init(params), params)
    g = jax.tree.map(lambda x: np.asarray(x, np.float64), grads)
    u = jax.tree.map(np.asarray, updates)
    block_g, block_u = g["encoder"]["layers_0"], u["encoder"]["layers_0"]

    def expected(matrix, shape):
        # Liu et al.: an update of RMS `rms` x sqrt(max(fan_in, fan_out)) x the orthogonal one.
        scale = rms * np.sqrt(max(matrix.shape))
        return -lr * scale * newton_schulz(matrix).reshape(shape)

    query = block_g["self_attention"]["query"]["kernel"]  # [8, 2, 3] as 8 x 6
    np.testing.assert_allclose(block_u["self_attention"]["query"]["kernel"],
                               expected(query.reshape(8, 6), query.shape), rtol=NS_RTOL,
                               atol=NS_RTOL * lr)
    out = block_g["self_attention"]["out"]["kernel"]  # [2, 3, 8] as 6 x 8
    np.testing.assert_allclose(block_u["self_attention"]["out"]["kernel"],
                               expected(out.reshape(6, 8), out.shape), rtol=NS_RTOL,
                               atol=NS_RTOL * lr)
    for name in ("ff_in", "ff_out"):
        kernel = block_g["ffn"][name]["kernel"]
        np.testing.assert_allclose(block_u["ffn"][name]["kernel"],
                                   expected(kernel, kernel.shape), rtol=NS_RTOL,
                                   atol=NS_RTOL * lr, err_msg=name)
    # Adam's first update, bias-corrected, is lr x g / (|g| + eps), whatever b1, b2: the
    # paper's Adam, without optax.contrib.muon's Nesterov (1.47 lr at b1 0.9). rtol 1e-5 covers
    # eps 1e-9 against gradients of 1e-4 or more and a few float32 roundings (6e-8 each).
    for leaf_g, leaf_u in [(g["embedding"]["embedding"], u["embedding"]["embedding"]),
                           (g["logits"]["kernel"], u["logits"]["kernel"]),
                           (block_g["ffn"]["ff_in"]["bias"], block_u["ffn"]["ff_in"]["bias"]),
                           (block_g["norm_ffn"]["scale"], block_u["norm_ffn"]["scale"])]:
        np.testing.assert_allclose(leaf_u, -lr * np.sign(leaf_g), rtol=1e-5)


@pytest.mark.parametrize("key,value,message", [
    ("muon_beta", 1.0, "optimizer.muon_beta=1.0 must be a number in [0, 1)"),
    ("muon_rms", 0, "optimizer.muon_rms=0 must be a number > 0"),
    ("moments_dtype", "bfloat16", "optimizer.moments_dtype='bfloat16' is for adam and adamw, "
                                  "not muon"),
])
def test_bad_muon_settings_are_one_line_naming_the_key(key, value, message):
    with pytest.raises(ValueError, match=f"^{message.replace('[', '.').replace(')', '.')}") as err:
        optim.make_optimizer(opt_config(**{key: value}), d_model=8, total_steps=10)
    assert "\n" not in str(err.value)
