"""Numerics of the train step on the paths production runs take: bfloat16 compute against
float32, every remat policy and scanned layers against the plain model."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import mesh_of, run, trainer_for

from transformer.checkpoint.checkpointer import stack_layers
from transformer.config import resolve
from transformer.data import make_source
from transformer.model.config import REMAT_POLICIES
from transformer.training import optim, train_state

# bfloat16 keeps 8 significant bits: one rounding is off by at most 2**-8 relatively.
BF16_UNIT_ROUNDOFF = 2.0 ** -8


@pytest.fixture(scope="module")
def tiny(load_config):
    """configs/tiny.py, 16 rows a batch, no dropout unless asked (the comparisons are exact
    functions of the params and batch)."""
    return lambda **o: load_config("tiny.py", **{"data.batch_size": 16,
                                                 "model.dropout_rate": 0.0, **o})


def first_batch(cfg) -> dict:
    """The first training batch [B, length] (the one microbatch)."""
    batch = make_source(cfg).train_batch(0, (0, int(cfg.data.batch_size)))
    return {k: jnp.asarray(v[0]) for k, v in batch.items()}


def loss_and_grads(cfg, params, batch, dropout_seed=None):
    """The train loss (label-smoothed, per target token) and its gradients, through the model
    the config builds (remat and scan included: they act under differentiation)."""
    model = train_state.Transformer(resolve(cfg).model)
    weights = train_state.loss_weights(batch)

    def loss_fn(p):
        rngs = None if dropout_seed is None else {"dropout": jax.random.key(dropout_seed)}
        logits = model.apply({"params": p}, batch["inputs"], batch["targets"],
                             deterministic=dropout_seed is None, rngs=rngs)
        sums = optim.cross_entropy_loss(logits, batch["targets"], weights,
                                        label_smoothing=float(cfg.label_smoothing))
        return sums.loss_sum / sums.weight_sum

    return jax.jit(jax.value_and_grad(loss_fn))(params)


def init_params(cfg):
    trainer = trainer_for(cfg, mesh_of((1, 1, 1), 1))
    return jax.device_get(train_state.init_state(trainer, 0).params)


def flat(tree) -> dict:
    return flax.traverse_util.flatten_dict(jax.device_get(tree), sep="/")


# --------------------------------------------------------------------------- bfloat16


def test_bfloat16_loss_and_gradients_match_float32(tiny):
    """The same params and batch through bfloat16 compute: the loss and every gradient agree
    with float32 to a few bfloat16 roundings, and the gradients stay float32."""
    params = init_params(tiny())
    batch = first_batch(tiny())
    loss32, grads32 = loss_and_grads(tiny(), params, batch)
    loss16, grads16 = loss_and_grads(tiny(**{"model.dtype": "bfloat16"}), params, batch)
    # The loss is a mean over ~200 tokens of float32 log-softmaxes of bfloat16 logits: the
    # rounding errors of the logits (each ~2**-8 relative) mostly average out. Measured
    # relative error 2.5e-4; bound: one unit roundoff (16x margin).
    assert abs(float(loss16) - float(loss32)) <= BF16_UNIT_ROUNDOFF * float(loss32)
    g32 = flat(grads32)
    g16 = flat(grads16)
    assert g32.keys() == g16.keys()
    assert all(g.dtype == np.float32 for g in g16.values())
    # The key biases' exact gradient is 0 (softmax ignores a shift shared by all keys): both
    # runs give rounding noise, measured <= 2e-5 of the gradient's norm in bfloat16.
    norm = np.sqrt(sum((g ** 2).sum() for g in g32.values()))
    noise = [p for p in g32 if p.endswith("key/bias")]
    for path in noise:
        assert np.linalg.norm(g16[path]) <= BF16_UNIT_ROUNDOFF * norm, path
    # Every other gradient passes 2 + 2 layers of bfloat16 matmuls and norms forward and back,
    # each rounding to ~2**-8: measured relative error of the whole gradient 3.0% (~8
    # roundoffs), of single parameters up to 5.7% (the decoder's ff_in kernels). Bounds: 16
    # roundoffs (6.25%) for the whole, 32 (12.5%) for each parameter.
    paths = [p for p in g32 if p not in noise]
    diff = np.sqrt(sum(((g16[p] - g32[p]) ** 2).sum() for p in paths))
    assert diff <= 16 * BF16_UNIT_ROUNDOFF * np.sqrt(sum((g32[p] ** 2).sum() for p in paths))
    for path in paths:
        error = np.linalg.norm(g16[path] - g32[path]) / np.linalg.norm(g32[path])
        assert error <= 32 * BF16_UNIT_ROUNDOFF, (path, error)


def test_bfloat16_train_step_keeps_params_and_optimizer_state_float32(tiny):
    cfg = tiny(**{"model.dtype": "bfloat16"})
    state, losses, _ = run(cfg, mesh_of((1, 1, 1), 1), 2)
    leaves = jax.tree_util.tree_leaves_with_path((state.params, state.opt_state))
    floats = [(path, leaf) for path, leaf in leaves if jnp.issubdtype(leaf.dtype, jnp.floating)]
    assert len(floats) == 3 * len(jax.tree.leaves(state.params))  # params, Adam's mu and nu
    for path, leaf in floats:
        assert leaf.dtype == np.float32, jax.tree_util.keystr(path)
    assert np.isfinite(losses).all()


@pytest.mark.slow
def test_bfloat16_training_converges_as_float32(tiny):
    """20 steps of the tiny task: the bfloat16 run's losses follow the float32 run's."""
    mesh = mesh_of((1, 1, 1), 1)
    _, losses32, _ = run(tiny(), mesh, 20)
    _, losses16, _ = run(tiny(**{"model.dtype": "bfloat16"}), mesh, 20)
    assert losses32[-1] < 0.85 * losses32[0]  # it learns (measured: 4.12 -> 3.31)
    # Measured worst relative difference 7.9e-4 (0.2 roundoff); bound: one roundoff.
    np.testing.assert_allclose(losses16, losses32, rtol=BF16_UNIT_ROUNDOFF)


@pytest.mark.parametrize("name", ["lm_125m.py", "lm_1b.py", "lm_8b.py"])
def test_accelerator_language_model_configs_compute_in_bfloat16(load_config, name):
    """The accelerator LM configs compute in bfloat16 (lm_default.py, the CPU config, sets
    float32 itself); params stay float32 (test above)."""
    model = resolve(load_config(name)).model
    assert model.dtype == "bfloat16"


# --------------------------------------------------------------------------- remat and scan


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(set(REMAT_POLICIES) - {"none"}))
def test_remat_policies_give_the_same_loss_and_gradients(tiny, policy):
    """Rematerialisation recomputes the forward pass (dropout included, from the same keys):
    the loss and gradients equal the plain model's to float32 rounding. (One layer each side:
    remat wraps each block alike.)"""
    one_layer = {"model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
                 "model.dropout_rate": 0.1}
    params = init_params(tiny(**one_layer))
    batch = first_batch(tiny())
    loss, grads = loss_and_grads(tiny(**one_layer), params, batch, 1)
    remat_loss, remat_grads = loss_and_grads(
        tiny(**one_layer, **{"model.remat_policy": policy}), params, batch, 1)
    # Recomputation may fuse differently: float32 rounding (2**-24) amplified by the depth;
    # measured worst relative difference 0 (identical programs on CPU).
    np.testing.assert_allclose(float(remat_loss), float(loss), rtol=1e-6)
    expected = flat(grads)
    for path, value in flat(remat_grads).items():
        np.testing.assert_allclose(value, expected[path], rtol=1e-5, atol=1e-7, err_msg=path)


@pytest.mark.parametrize("policy", ["none", pytest.param("dots", marks=pytest.mark.slow)])
def test_scanned_layers_give_the_same_loss_and_gradients(tiny, policy):
    """`scan_layers=True` with the same params (stacked by checkpoint.stack_layers): the loss
    and the gradients, stacked alike, equal the per-layer model's."""
    params = init_params(tiny())
    batch = first_batch(tiny())
    loss, grads = loss_and_grads(tiny(), params, batch)
    scan_loss, scan_grads = loss_and_grads(
        tiny(**{"model.scan_layers": True, "model.remat_policy": policy}),
        stack_layers(params), batch)
    np.testing.assert_allclose(float(scan_loss), float(loss), rtol=1e-6)
    expected = flat(stack_layers(grads))
    actual = flat(scan_grads)
    assert actual.keys() == expected.keys()
    for path, value in actual.items():
        # float32 rounding (2**-24 ~ 6e-8) of sums in another order; measured worst 2e-7.
        np.testing.assert_allclose(value, expected[path], rtol=1e-5, atol=1e-7, err_msg=path)


@pytest.mark.slow
def test_train_step_with_scan_and_remat_matches_the_plain_step(tiny):
    """The whole jitted train step (loss, gradient norm, updated params) with scanned,
    rematerialised layers on the 2 x 2 x 2 mesh against the plain model on one device."""
    plain_cfg = tiny()
    scan_cfg = tiny(**{"model.scan_layers": True, "model.remat_policy": "dots_no_batch"})
    mesh = mesh_of((2, 2, 2))
    one = mesh_of((1, 1, 1), 1)
    plain_trainer = trainer_for(plain_cfg, one)
    state = train_state.init_state(plain_trainer, 0)
    scan_trainer = trainer_for(scan_cfg, mesh)
    # Adam's initial state is zeros whatever the params: only the params need converting.
    scan_state = train_state.init_state(scan_trainer, 0).replace(params=jax.device_put(
        stack_layers(jax.device_get(state.params)), scan_trainer.state_shardings.params))
    source = make_source(plain_cfg)
    plain_step = train_state.make_train_step(plain_trainer, resolve(plain_cfg, 1).config)
    scan_step = train_state.make_train_step(scan_trainer, resolve(scan_cfg, 8).config)
    state, plain_metrics = plain_step(state, train_state.global_batch(
        one, source.train_batch(0, (0, 16))))
    scan_state, scan_metrics = scan_step(scan_state, train_state.global_batch(
        mesh, source.train_batch(0, (0, 16))))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(scan_metrics[key]), float(plain_metrics[key]),
                                   rtol=1e-5, err_msg=key)
    expected = flat(stack_layers(jax.device_get(state.params)))
    for path, value in flat(scan_state.params).items():
        # Adam's first update is ~lr * sign(gradient): rounding-size gradients (the key
        # biases, see test_train.assert_params_close) may step either way.
        atol = 2 * 3e-3 / 50 if path.endswith("key/bias") else 1e-6
        np.testing.assert_allclose(value, expected[path], rtol=1e-4, atol=atol, err_msg=path)
