"""The Vision Transformer (`transformer/model/vit.py`): patch embedding and pooling against numpy,
position-embedding resizing, the ViT paper's Table 1 parameter counts, sharded = unsharded, and
a loss that falls under plain optax Adam on the committed Fashion-MNIST fixture."""

import pathlib
import runpy

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer.model import vit
from transformer.model.config import TransformerConfig
from transformer.parallel import sharding
from transformer.sizing import flops

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "offline_fashion_mnist"


def tiny(**overrides) -> TransformerConfig:
    values = dict(architecture="vision", image_size=8, patch_size=4, num_channels=3,
                  num_classes=5, num_encoder_layers=2, d_model=16, d_ff=32, num_heads=2,
                  positional="learned", norm_position="pre", activation="gelu",
                  dropout_rate=0.0)
    return TransformerConfig(**(values | overrides))


def numpy_conv(images, kernel, stride):
    """A strided VALID convolution written out: images [B, H, W, C], kernel [P, P, C, D]."""
    b, h, w, _ = images.shape
    p = kernel.shape[0]
    d = kernel.shape[-1]
    out = np.zeros((b, h // stride, w // stride, d))
    for i in range(h // stride):
        for j in range(w // stride):
            window = images[:, i * stride:i * stride + p, j * stride:j * stride + p, :]
            out[:, i, j] = np.einsum("bxyc,xycd->bd", window, kernel)
    return out


def test_patch_embedding_is_a_strided_convolution():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(2, 12, 12, 3)).astype(np.float32)
    kernel = rng.normal(size=(4 * 4 * 3, 5)).astype(np.float32)
    embedded = np.asarray(vit.patchify(jnp.asarray(images), 4) @ kernel)  # [B, 9, D]
    conv = numpy_conv(images.astype(np.float64), kernel.reshape(4, 4, 3, 5), 4)
    np.testing.assert_allclose(embedded, conv.reshape(2, 9, 5), rtol=1e-5, atol=1e-5)
    lax_conv = jax.lax.conv_general_dilated(images, kernel.reshape(4, 4, 3, 5), (4, 4), "VALID",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(embedded, np.asarray(lax_conv).reshape(2, 9, 5), rtol=1e-5,
                               atol=1e-5)
    # patch (row 1, column 2) is pixels [4:8, 8:12] flattened (row, column, channel)
    np.testing.assert_array_equal(np.asarray(vit.patchify(jnp.asarray(images), 4))[:, 5],
                                  images[:, 4:8, 8:12].reshape(2, -1))


def _layers_identity(params):
    """The params with every encoder layer's sublayer output zeroed (out and ff_out kernels
    and biases): each pre-LN block then passes its input through unchanged."""
    def zero(path, leaf):
        names = [getattr(k, "key", "") for k in path]
        return jnp.zeros_like(leaf) if {"out", "ff_out"} & set(names) else leaf
    return jax.tree_util.tree_map_with_path(zero, params)


@pytest.mark.parametrize("pooling", ["cls", "gap"])
def test_pooling_and_head_against_numpy(pooling):
    cfg = tiny(pooling=pooling)
    model = vit.VisionTransformer(cfg)
    images = np.random.default_rng(1).normal(size=(3, 8, 8, 3)).astype(np.float32)
    params = nn.unbox(model.init(jax.random.key(0), jnp.asarray(images))["params"])
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
    assert np.all(np.asarray(apply(params, images)) == 0.0)  # the zero-initialised head
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), params)
    params = _layers_identity(params)
    p = jax.tree.map(np.asarray, params)
    tokens = vit.patchify(images, 4) @ p["patch_embedding"]["kernel"] + p["patch_embedding"][
        "bias"]
    if pooling == "cls":
        tokens = np.concatenate([np.broadcast_to(p["class_token"], (3, 1, 16)), tokens], 1)
    tokens = tokens + p["position_embedding"]
    assert p["position_embedding"].shape == (vit.num_tokens(cfg), 16) == (4 + (pooling == "cls"),
                                                                          16)
    norm = p["encoder"]["norm"]
    mean = tokens.mean(-1, keepdims=True)
    var = tokens.var(-1, keepdims=True)
    normed = (tokens - mean) / np.sqrt(var + cfg.norm_eps) * norm["scale"] + norm["bias"]
    pooled = normed[:, 0] if pooling == "cls" else normed.mean(1)
    expected = pooled @ p["head"]["kernel"] + p["head"]["bias"]
    got = apply(params, images)
    assert got.shape == (3, 5) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4)


def test_mirror_averaged_logits_against_numpy():
    model = vit.VisionTransformer(tiny())
    rng = np.random.default_rng(4)
    images = rng.normal(size=(3, 8, 8, 3)).astype(np.float32)
    params = nn.unbox(model.init(jax.random.key(0), jnp.asarray(images))["params"])
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), params)

    def logits_fn(x):
        return model.apply({"params": params}, x)

    def softmax(z):
        z = np.asarray(z, np.float64)
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    mirrored = images[:, :, ::-1]  # columns reversed: [B, H, W, C]
    want = (softmax(logits_fn(images)) + softmax(logits_fn(mirrored))) / 2
    got = np.asarray(vit.mirror_averaged_logits(logits_fn, jnp.asarray(images)))
    assert got.shape == (3, 5) and got.dtype == np.float32
    np.testing.assert_allclose(np.exp(got), want, rtol=1e-5, atol=1e-6)
    assert np.abs(softmax(logits_fn(images)) - want).max() > 1e-3  # the mirror changed them
    symmetric = (images + mirrored) / 2  # its own mirror image: the average is the image's
    np.testing.assert_allclose(np.exp(vit.mirror_averaged_logits(logits_fn, symmetric)),
                               softmax(logits_fn(symmetric)), rtol=1e-5, atol=1e-6)


def test_wrong_image_shape_is_one_line():
    model = vit.VisionTransformer(tiny())
    with pytest.raises(ValueError, match=r"model.image_size=8, num_channels=3: want \(8, 8, 3\)"):
        model.init(jax.random.key(0), jnp.zeros((1, 9, 9, 3)))


def test_config_checks_name_the_key():
    with pytest.raises(ValueError, match="model.patch_size=3 does not divide image_size=8"):
        tiny(patch_size=3)
    with pytest.raises(ValueError, match="model.pooling='max' is not one of cls, gap"):
        tiny(pooling="max")
    with pytest.raises(ValueError, match="model.positional='rope': the vision model"):
        tiny(positional="rope")


def test_resize_position_embeddings():
    rng = np.random.default_rng(3)
    posemb = jnp.asarray(rng.normal(size=(1 + 16, 8)), jnp.float32)
    same = vit.resize_position_embeddings(posemb, 4, 4, has_class_token=True)
    np.testing.assert_allclose(np.asarray(same), np.asarray(posemb), atol=1e-6)
    # A linear ramp a + b*row + c*column on the old grid resizes to the same ramp sampled at
    # each new cell's centre in old coordinates, (i + 0.5) * old / new - 0.5, clamped to the
    # grid (half-pixel centres, edge values held).
    old = (4, 3)
    new = (8, 6)
    rows, cols = np.meshgrid(np.arange(old[0]), np.arange(old[1]), indexing="ij")
    coeffs = rng.normal(size=(3, 8))
    ramp = (coeffs[0] + rows[..., None] * coeffs[1] + cols[..., None] * coeffs[2]).reshape(-1, 8)
    resized = vit.resize_position_embeddings(jnp.asarray(ramp, jnp.float32), old, new,
                                             has_class_token=False)
    r = np.clip((np.arange(new[0]) + 0.5) * old[0] / new[0] - 0.5, 0, old[0] - 1)
    c = np.clip((np.arange(new[1]) + 0.5) * old[1] / new[1] - 0.5, 0, old[1] - 1)
    rr, cc = np.meshgrid(r, c, indexing="ij")
    expected = (coeffs[0] + rr[..., None] * coeffs[1] + cc[..., None] * coeffs[2]).reshape(-1, 8)
    np.testing.assert_allclose(np.asarray(resized), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not form the 5x5 grid"):
        vit.resize_position_embeddings(posemb, 5, 6, has_class_token=True)


def _vit_config(arg: str) -> TransformerConfig:
    cfg = runpy.run_path(str(ROOT / "configs" / "vit.py"))["get_config"](arg)
    return TransformerConfig.from_dict(cfg.model)


def _closed_form(cfg: TransformerConfig) -> int:
    """Table 1's models counted by hand: per layer 4 D^2 + 4 D (q, k, v, out and biases),
    2 D F + F + D (MLP), 4 D (two LayerNorms); patch embedding (P^2 C + 1) D; class token D;
    positions (G^2 + 1) D; final norm 2 D; head (D + 1) K."""
    d = cfg.d_model
    f = cfg.d_ff
    k = cfg.num_classes
    layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
    patch = (cfg.patch_size ** 2 * cfg.num_channels + 1) * d
    return (cfg.num_encoder_layers * layer + patch + d + (cfg.num_patches + 1) * d + 2 * d
            + (d + 1) * k)


@pytest.mark.parametrize("arg, paper_millions", [("B/16", 86), ("L/16", 307), ("H/14", 632)])
def test_table1_parameter_counts(arg, paper_millions):
    """The ViT paper's Table 1 (1,000 classes, 224 px), within 1%: the paper rounds, and its
    L/16 figure (307M) sits 0.9% above the count of the model it describes (304.3M, as other
    implementations count it too)."""
    cfg = _vit_config(arg)
    total = flops.param_counts(cfg)["total"]
    assert total == _closed_form(cfg)
    assert abs(total / 1e6 - paper_millions) / paper_millions < 0.01


def test_sharded_forward_equals_unsharded():
    cfg = tiny(num_heads=4, d_model=32, d_ff=64, scan_layers=True)
    model = vit.VisionTransformer(cfg)
    images = np.random.default_rng(4).normal(size=(8, 8, 8, 3)).astype(np.float32)
    boxed = jax.eval_shape(model.init, jax.random.key(0), images)["params"]
    params = jax.tree.map(lambda a: jnp.asarray(np.random.default_rng(5).normal(
        size=a.shape) * 0.2, jnp.float32), nn.unbox(boxed))
    expected = model.apply({"params": params}, images)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = sharding.tree_shardings(boxed, mesh)
    # the scanned layer axis on "stage" (size 1 here: whole on every device)
    assert shardings["encoder"]["layers"]["ffn"]["ff_in"]["kernel"].spec == jax.P(
        "stage", "fsdp", "tensor")
    sharded = jax.device_put(params, shardings)
    batch = jax.device_put(images, jax.sharding.NamedSharding(mesh, jax.P(sharding.BATCH_AXES)))

    @jax.jit
    def forward(p, x):
        with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
                jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return model.apply({"params": p}, x)

    got = forward(sharded, batch)
    assert got.sharding.spec[0] == ("data", "fsdp")  # BATCH_AXES less "expert", of size 1
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_adam_on_the_fixture_makes_the_loss_fall():
    """A few steps of plain optax Adam on the committed Fashion-MNIST images: no train_state."""
    from transformer.data.offline import fashion_mnist

    images, labels = fashion_mnist.read_split(str(FIXTURE), "train")
    x = jnp.asarray(images[:32], jnp.float32) / 255.0 - 0.3
    y = jnp.asarray(labels[:32])
    cfg = tiny(image_size=28, patch_size=7, num_channels=1, num_classes=10, d_model=32,
               d_ff=64, num_encoder_layers=1)
    model = vit.VisionTransformer(cfg)
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)
    losses = []
    for _ in range(20):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[0] == pytest.approx(np.log(10), rel=1e-5)  # the zero head: uniform logits
    assert losses[-1] < 0.5 * losses[0]
