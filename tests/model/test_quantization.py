"""Quantized training matmuls (transformer/model/quantization.py, Qwix): a quantized matmul and
its gradients (int8, int8_full) against numpy's per-channel symmetric int8, the classes chosen,
int8 training equal on 1x8 and 2x4 meshes, and one line for each bad setting."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer.config import resolve
from transformer.data import make_source
from transformer.model import blocks, quantization
from transformer.model.config import TransformerConfig
from transformer.model.transformer import Transformer
from transformer.parallel import sharding
from transformer.training import train_state

pytest.importorskip("qwix")  # the `quantize` extra (make install has it)
# Qwix 0.1.8 checks for nnx.VariableState, which flax 0.12 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:'VariableState' was removed:DeprecationWarning")
D, F = 32, 24


class Projection(nn.Module):
    """x [B,T,D] @ ff_in [D,F], the kernel owned by a child as in the model's blocks."""

    @nn.compact
    def __call__(self, x):
        kernel, _ = blocks.Weights((D, F), ("embed", "mlp"), use_bias=False, name="ff_in")()
        return jnp.einsum("BTD,DF->BTF", x, kernel)


class Top(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Projection(name="ffn")(x)


def int8_per_channel(x, axis):
    """Symmetric int8 with one scale per slice along the other axes: absmax over `axis` /
    127.5 (Qwix's bound, qmax + 0.5), values rounded half to even and saturated to int8."""
    scale = np.max(np.abs(x), axis=axis, keepdims=True) / np.float32(127.5)
    return np.clip(np.round(x / scale), -128, 127).astype(np.int64), scale.astype(np.float32)


def on_grid(rng, shape, axis):
    """Values whose int8 quantization along `axis` is free of float rounding: each slice is
    2**k times numbers at least 0.1 from a rounding boundary, its absmax 127.5 x 2**k, so the
    scale is the power of two 2**k and dividing by it is exact."""
    values = rng.integers(-120, 121, shape) + rng.uniform(-0.4, 0.4, shape)
    first = [slice(None)] * len(shape)
    first[axis] = 0
    values[tuple(first)] = 127.5 * rng.choice([-1.0, 1.0], values[tuple(first)].shape)
    scale_shape = list(shape)
    scale_shape[axis] = 1
    return (values * 2.0 ** rng.integers(-9, -5, scale_shape)).astype(np.float32)


@pytest.fixture(scope="module")
def projection():
    rng = np.random.default_rng(0)
    x = on_grid(rng, (2, 5, D), axis=2)
    model = Top()
    params = nn.unbox(model.init(jax.random.key(0), jnp.asarray(x))["params"])
    params["ffn"]["ff_in"]["kernel"] = jnp.asarray(on_grid(rng, (D, F), axis=0))
    return x, model, params


def test_int8_matmul_matches_numpy_per_channel_int8(projection):
    x, model, params = projection
    kernel = np.asarray(params["ffn"]["ff_in"]["kernel"])
    quantized = quantization.quantize(model, "int8", "feed_forward")
    y = np.asarray(jax.jit(lambda p: quantized.apply({"params": p}, jnp.asarray(x)))(params))
    qx, sx = int8_per_channel(x, axis=2)  # a scale per token
    qw, sw = int8_per_channel(kernel, axis=0)  # a scale per output channel
    assert {qx.max(), qw.max()} <= {127} and qx.min() >= -128  # 127.5 saturates at 127
    # Exact: integer products (|sum| < 2**24) times power-of-two scales.
    expected = (np.einsum("btd,df->btf", qx, qw) * sx * sw).astype(np.float32)
    np.testing.assert_array_equal(y, expected)
    exact = np.einsum("btd,df->btf", x, kernel)
    assert np.max(np.abs(y - exact) / np.abs(exact).max()) > 1e-3  # not the float32 product

    # Qwix's backward pass for int8 (gradients unquantized): straight through, the incoming
    # gradient times the other operand as it was before quantization, here x.
    grad = jax.grad(lambda p: quantized.apply({"params": p}, jnp.asarray(x)).sum())(params)
    np.testing.assert_allclose(grad["ffn"]["ff_in"]["kernel"],
                               np.einsum("btd->d", x)[:, None].repeat(F, 1),
                               rtol=1e-6)  # float32 sums of 10 terms: a few ulps


def test_int8_full_quantizes_both_gradient_matmuls_as_numpy_does(projection):
    """int8_full's backward pass (Qwix's bwd_qtype=int8): the incoming gradient g times the
    other operand's forward scale, quantized to int8 over the gradient matmul's contracted
    axes, times that operand's int8 values from the forward pass. Each cotangent is chosen so
    that the scaled gradient lies on the grid of `on_grid` (power-of-two scales, no value near
    a rounding boundary): integer sums times powers of two, so equal exactly."""
    x, model, params = projection
    kernel = np.asarray(params["ffn"]["ff_in"]["kernel"])
    qx, sx = int8_per_channel(x, axis=2)  # sx [B, T, 1]
    qw, sw = int8_per_channel(kernel, axis=0)  # sw [1, F]
    rng = np.random.default_rng(1)
    for name in ("int8_full", "int8"):
        quantized = quantization.quantize(model, name, "feed_forward")
        _, vjp = jax.vjp(quantized.apply, {"params": params}, jnp.asarray(x))
        # d x = g @ kernel^T: g x sw per token (contracted over F), times qw.
        wanted = on_grid(rng, (2, 5, F), axis=2)
        dx = np.asarray(jax.jit(vjp)(jnp.asarray(wanted / sw))[1])
        qg, sg = int8_per_channel(wanted, axis=2)
        expected_dx = (np.einsum("btf,df->btd", qg, qw) * sg).astype(np.float32)
        # d kernel = x^T @ g: g x sx per output channel (contracted over B and T), times qx.
        wanted = on_grid(rng, (10, F), axis=0)
        dkernel = np.asarray(jax.jit(vjp)(jnp.asarray(wanted.reshape(2, 5, F) / sx))[0]
                             ["params"]["ffn"]["ff_in"]["kernel"])
        qg, sg = int8_per_channel(wanted, axis=0)
        expected_dkernel = (np.einsum("nd,nf->df", qx.reshape(10, D), qg) * sg).astype(
            np.float32)
        if name == "int8_full":
            np.testing.assert_array_equal(dx, expected_dx)
            np.testing.assert_array_equal(dkernel, expected_dkernel)
        else:  # int8's gradients are float products: not the int8 ones
            assert np.max(np.abs(dx - expected_dx)) > 1e-3 * np.abs(expected_dx).max()
            assert np.max(np.abs(dkernel - expected_dkernel)) > (
                1e-3 * np.abs(expected_dkernel).max())


def test_none_and_other_classes_leave_the_matmul_alone(projection):
    x, model, params = projection
    exact = model.apply({"params": params}, jnp.asarray(x))
    for unchanged in (quantization.quantize(model, "none"),
                      quantization.quantize(model, "int8", "attention,experts")):
        np.testing.assert_array_equal(unchanged.apply({"params": params}, jnp.asarray(x)), exact)


def test_the_model_quantizes_its_projections_not_scores_logits_or_embeddings(monkeypatch):
    """A 1 + 1 layer encoder-decoder: 4 attention projections in each of its 3 attentions and
    2 feed-forward matmuls in each of its 2 layers, nothing else."""
    from qwix._src.providers import qt

    cfg = TransformerConfig(vocab_size=48, num_encoder_layers=1, num_decoder_layers=1,
                            d_model=32, d_ff=64, num_heads=4, max_len=16)
    tokens = jnp.ones((2, 8), jnp.int32)
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), tokens, tokens)["params"]
    seen = []
    original = qt.dot_general_qt.dot_general_qt

    def spy(lhs, rhs, dimension_numbers, config):
        seen.append((lhs.shape, rhs.shape))
        return original(lhs, rhs, dimension_numbers, config)

    monkeypatch.setattr(qt.dot_general_qt, "dot_general_qt", spy)
    for matmuls, count in (("attention,feed_forward", 16), ("feed_forward", 4)):
        seen.clear()
        quantized = quantization.quantize(model, "int8", matmuls)
        jax.eval_shape(quantized.apply, {"params": params}, tokens, tokens)
        assert len(seen) == count, matmuls
    # Every one multiplies activations [B, T, ...] by a kernel [D, N, H], [N, H, D], [D, F] or
    # [F, D]: never the scores (5-D), the embedding or the logits (V = 48).
    assert all(len(lhs) in (3, 4) and len(rhs) in (2, 3) and 48 not in lhs + rhs
               for lhs, rhs in seen)


def test_experts_quantize_their_grouped_products_not_the_router(monkeypatch):
    """A routed layer without capacity (ragged_dot): ff_in and ff_out of the experts, [E, D, F]
    and [E, F, D]; the router [D, E] stays in float32."""
    from qwix._src.providers import qt

    cfg = TransformerConfig(architecture="decoder", vocab_size=48, num_encoder_layers=0,
                            num_decoder_layers=1, d_model=32, d_ff=64, num_heads=4, max_len=16,
                            num_experts=4, experts_per_token=2)
    tokens = jnp.ones((2, 8), jnp.int32)
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), None, tokens)["params"]
    seen = []
    original = qt.ragged_dot_qt.ragged_dot_qt

    def spy(lhs, rhs, *args):
        seen.append(rhs.shape)
        return original(lhs, rhs, *args)

    monkeypatch.setattr(qt.ragged_dot_qt, "ragged_dot_qt", spy)
    monkeypatch.setattr(qt.dot_general_qt, "dot_general_qt", None)  # nothing else
    quantized = quantization.quantize(model, "int8", "experts")
    jax.eval_shape(quantized.apply, {"params": params}, None, tokens)
    assert seen == [(4, 32, 64), (4, 64, 32)]


@pytest.mark.parametrize("settings,message", [
    (dict(quantization="int4"),
     "model.quantization='int4' is not one of none, int8, int8_full, fp8"),
    (dict(quantization="int8", quantized_matmuls="attention,logits"),
     "model.quantized_matmuls names 'logits', which is not a matmul class; use a "
     "comma-separated list of attention, feed_forward, experts"),
])
def test_bad_quantization_settings_are_one_line(settings, message):
    with pytest.raises(ValueError, match=f"^{message}$") as raised:
        TransformerConfig(**settings)
    assert "\n" not in str(raised.value)


def test_fp8_on_a_cpu_is_one_line(load_config):
    """XLA's CPU backend has no fp8 matmul (it upcasts to float32): refused when the trainer
    is built, before any compile."""
    cfg = load_config("tiny.py", **{"model.quantization": "fp8"})
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    with pytest.raises(ValueError, match="^model.quantization='fp8' needs fp8 matmuls") as raised:
        train_state.build_trainer(resolve(cfg, 1), mesh)
    assert "cpu: use 'int8' or 'none'" in str(raised.value) and "\n" not in str(raised.value)


# ---- int8 training on two layouts ---------------------------------------------------------------

STEPS = 3


def train(load_config, data: int, fsdp: int):
    cfg = load_config("tiny.py", **{
        "data.batch_size": 16, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
        "model.dropout_rate": 0.0, "model.quantization": "int8"})
    cfg.mesh.data, cfg.mesh.fsdp = data, fsdp
    run = resolve(cfg, 8)
    mesh = sharding.make_mesh(run.config.mesh, jax.devices()[:8])
    trainer = train_state.build_trainer(run, mesh)
    step = train_state.make_train_step(trainer, run.config)
    source = make_source(cfg)
    state = train_state.init_state(trainer, cfg.seed)
    losses = []
    for index in range(STEPS):
        batch = source.train_batch(index, (0, source.rows_per_batch))
        state, metrics = step(state, train_state.global_batch(mesh, batch))
        losses.append(float(metrics["loss"]))
    # The program multiplies int8 operands (StableHLO's i8 tensors).
    assert "xi8>" in step.lower(state, train_state.global_batch(mesh, batch)).as_text()
    return losses, jax.device_get(state.params)


def init_params(load_config):
    cfg = load_config("tiny.py", **{
        "data.batch_size": 16, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
        "model.dropout_rate": 0.0})
    run = resolve(cfg, 1)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    return train_state.init_state(train_state.build_trainer(run, mesh), cfg.seed).params


def test_int8_training_on_2x4_equals_1x8(load_config):
    losses, params = train(load_config, 1, 8)
    other_losses, other_params = train(load_config, 2, 4)
    # The first step: the same params, exact int8 products and scales whose maxima do not
    # depend on the order of reduction, so only float32 sums differ (1e-7 relative a sum,
    # 1e-5 with margin). Later losses inherit the params' drift (below): they differ by a
    # small part of how far the loss has fallen, 1% with margin (jax 0.12.1 gave 0.06%).
    np.testing.assert_allclose(other_losses[0], losses[0], rtol=1e-5)
    fallen = np.abs(losses[0] - np.asarray(losses[1:]))
    assert np.all(np.abs(np.asarray(other_losses[1:]) - losses[1:]) < 0.01 * fallen)
    assert losses[-1] < losses[0]
    # The params: an int8 rounding flip changes a gradient element by ~1/127 of its row's
    # range, and Adam's first updates are about +-lr wherever a gradient is near zero, so
    # a few elements move apart by up to 2 lr a step; in the whole tree the two runs stay
    # within 5% of the distance they travelled (unrelated runs would be ~100% apart).
    initial = jax.device_get(init_params(load_config))
    travelled = optax.tree.norm(jax.tree.map(jnp.subtract, params, initial))
    apart = optax.tree.norm(jax.tree.map(jnp.subtract, other_params, params))
    assert apart < 0.05 * travelled
