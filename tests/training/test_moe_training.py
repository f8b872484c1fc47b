"""Mixture-of-experts training end to end on fake CPU devices: encoder-decoder, decoder and
encoder models take routed layers, and training logs the routers' metrics; 8 devices with
`mesh.expert=4` (beside data or fsdp) give the losses and parameters of 1 device step for
step, and the checkpoint restores onto another mesh; bad expert settings are one line each."""

import flax
import jax
import numpy as np
import pytest
from conftest import train_steps
from jax.sharding import PartitionSpec as P

from transformer.checkpoint.checkpointer import Checkpointer
from transformer.config import resolve
from transformer.model import experts
from transformer.model.transformer import Transformer, TransformerConfig, init_cache, shift_right
from transformer.parallel import sharding
from transformer.training import train_state

MOE = {"model.num_experts": 4, "model.experts_per_token": 2, "model.dropout_rate": 0.0,
       "model.d_model": 32, "model.d_ff": 32, "data.batch_size": 8, "data.max_length": 15,
       "model.max_len": 16}


def _mesh(n, **axes):
    return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, **axes}, jax.devices()[:n])


@pytest.mark.parametrize("architecture,fields", [
    ("encoder_decoder", {"model.moe_shared_expert": True}),
    ("decoder", {"model.moe_layer_interval": 2, "model.moe_capacity_factor": 1.0,
                 "model.moe_router_scores": "sigmoid"}),
])
def test_translation_and_lm_train_with_experts(load_config, architecture, fields):
    """Three steps on one device: the loss falls and the routers' metrics are on the line."""
    cfg = load_config("tiny.py", **{**MOE, "model.architecture": architecture, **fields})
    state, lines, _ = train_steps(cfg, _mesh(1), 3)
    layers = state.params["decoder"]
    routed = "layers_1" if architecture == "decoder" else "layers_0"
    assert layers[routed]["moe"]["ff_in"].shape == (4, 32, 32)
    assert ("ffn" in layers[routed]) == (architecture == "encoder_decoder")  # shared expert
    if architecture == "decoder":  # every second layer routed
        assert "moe" not in layers["layers_0"] and "ffn" in layers["layers_0"]
    else:
        assert "moe" in state.params["encoder"]["layers_1"]
    for line in lines:
        assert 0 < line["expert_load_min"] <= 0.25 <= line["expert_load_max"] <= 1
        assert line["router_z_loss"] > 0 and line["moe_aux_loss"] > 0
        assert (line["moe_dropped"] > 0) == (architecture == "decoder")  # capacity 1: drops
    assert lines[-1]["loss"] < lines[0]["loss"]


@pytest.mark.slow
def test_train_py_writes_the_routers_metrics_on_every_train_line(load_config, tmp_path):
    """metrics.jsonl (what curves, TensorBoard and a user read), not only the step's output:
    every train line of a routed run carries the five router metrics, a dense run's none."""
    import json

    from transformer.training.loop import train_and_evaluate

    for name, fields in (("routed", {**MOE, "model.moe_capacity_factor": 1.0}), ("dense", {})):
        cfg = load_config("tiny.py", **fields, num_train_steps=2, log_every_steps=1,
                          eval_every_steps=0, checkpoint_every_steps=0)
        train_and_evaluate(cfg, str(tmp_path / name))
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        train = [line for line in lines if line["split"] == "train"]
        assert [line["step"] for line in train] == [1, 2]
        for line in train:
            if name == "dense":
                assert not set(train_state.MOE_METRICS) & set(line)
                continue
            assert 0 < line["expert_load_min"] <= 0.25 <= line["expert_load_max"] <= 1
            assert line["router_z_loss"] > 0 and line["moe_aux_loss"] > 0
            assert 0 <= line["moe_dropped"] < 1


def test_encoder_takes_experts():
    """An encoder-only model's routed layers record their statistics and get gradients."""
    cfg = TransformerConfig(architecture="encoder", vocab_size=32, num_encoder_layers=2,
                            d_model=16, d_ff=16, num_heads=2, max_len=8, num_experts=4,
                            experts_per_token=1, dropout_rate=0.0)
    model = Transformer(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 1, 32)
    params = model.init(jax.random.key(0), tokens, tokens)["params"]

    def loss(params):
        logits, records = model.apply({"params": params}, tokens, tokens,
                                      mutable=[experts.COLLECTION])
        return logits.mean() + experts.statistics(records)["moe_aux_loss"]

    grads = jax.grad(loss)(params)
    for name in ("router", "ff_in", "ff_out"):
        assert np.abs(grads["encoder"]["layers_1"]["moe"][name].value).sum() > 0, name


@pytest.mark.parametrize("capacity_factor,axes", [
    (0.0, {"data": 2}), (1.0, {"data": 2}), (0.0, {"tensor": 2})],
    ids=["dropless", "capacity", "dropless-tensor2"])
def test_expert_parallel_matches_one_device(load_config, tmp_path, capacity_factor, axes):
    """A decoder LM: 3 steps on 8 devices (data or tensor 2 x expert 4; with capacity, tokens
    sent all-to-all and some dropped; dropless, tokens all-gathered and outputs
    reduce-scattered, biases added once beside tensor) give 1 device's losses, drops and
    parameters; its checkpoint restores onto fsdp 2 x expert 4 and goes on as the 1-device
    run."""
    cfg = load_config("tiny.py", **{**MOE, "model.architecture": "decoder",
                                    "model.num_decoder_layers": 1,  # routed: half the compiling
                                    "model.moe_capacity_factor": capacity_factor})
    expected_state, expected, _ = train_steps(cfg, _mesh(1), 5)
    state, lines, _ = train_steps(cfg, _mesh(8, expert=4, **axes), 3)
    for line, want in zip(lines, expected, strict=False):
        for key in ("loss", "moe_aux_loss", "router_z_loss", "expert_load_max", "moe_dropped"):
            np.testing.assert_allclose(line[key], want[key], rtol=2e-5, err_msg=key)
        assert (line["moe_dropped"] > 0) == bool(capacity_factor)
    kernel = state.params["decoder"]["layers_0"]["moe"]["ff_in"]
    assert kernel.sharding.spec[0] == "expert"

    checkpointer = Checkpointer(str(tmp_path), keep=1)
    checkpointer.save(3, state, {"next_batch_index": 3})
    checkpointer.close()
    cfg.mesh.update({"data": 1, "fsdp": 2, "expert": 4})
    other = _mesh(8, fsdp=2, expert=4)
    restored, _ = Checkpointer(str(tmp_path), keep=1).restore(
        3, train_state.build_trainer(resolve(cfg, 8), other).abstract_state)
    assert restored.params["decoder"]["layers_0"]["moe"]["ff_in"].sharding.spec == P(
        "expert", "fsdp", "tensor")
    state, lines, _ = train_steps(cfg, other, 2, state=restored, first_batch=3)
    for line, want in zip(lines, expected[3:], strict=True):
        np.testing.assert_allclose(line["loss"], want["loss"], rtol=2e-5)
    got, want = (flax.traverse_util.flatten_dict(jax.device_get(s.params), sep="/")
                 for s in (state, expected_state))
    # Adam moves an element by about lr a step whatever its gradient's size, so where a
    # gradient is near zero, float32 rounding (the sharded sums add in another order) can turn
    # a step around: such an element may end up to 2 x (the sum of the lrs) from the other
    # run's. The key biases' gradient is all rounding noise (softmax ignores a shift shared by
    # all keys); elsewhere such elements are rare (under 1% of the tree), and the rest agree
    # to 1e-4.
    drift = 2 * sum(line["learning_rate"] for line in expected)
    off = {path: ~np.isclose(got[path], value, rtol=1e-4, atol=1e-5)
           for path, value in want.items() if not path.endswith("key/bias")}
    count, size = (sum(f(o) for o in off.values()) for f in (np.sum, np.size))
    assert count < 0.01 * size, {path: int(o.sum()) for path, o in off.items() if o.any()}
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, rtol=0, atol=drift, err_msg=path)


@pytest.mark.parametrize("fields,message", [
    ({"num_experts": 2, "experts_per_token": 3},
     "model.experts_per_token=3 must be in 1..model.num_experts=2"),
    ({"num_experts": 4, "moe_capacity_factor": 0.5},
     "model.moe_capacity_factor=0.5 drops tokens even from a balanced router"),
])
def test_bad_expert_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**fields)


def test_expert_axis_must_divide_the_experts(load_config):
    cfg = load_config("tiny.py", **{**MOE, "model.num_experts": 6, "mesh.expert": 4,
                                    "mesh.data": 2})
    with pytest.raises(ValueError, match="mesh.expert=4 does not divide model.num_experts=6"):
        resolve(cfg, 8)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["decoder", "encoder_decoder"])
def test_cached_decoding_equals_the_full_forward(architecture):
    """Token by token through the cache, the routed (dropless) model gives its training
    forward's logits: routing is per token."""
    cfg = TransformerConfig(architecture=architecture, vocab_size=32, num_encoder_layers=1,
                            num_decoder_layers=2, d_model=16, d_ff=16, num_heads=2, max_len=8,
                            num_experts=4, experts_per_token=2, dropout_rate=0.0,
                            activation="swiglu", use_bias=False)
    model = Transformer(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 4, 32)
    inputs = tokens if architecture == "encoder_decoder" else None
    variables = model.init(jax.random.key(0), inputs, tokens)
    full = model.apply(variables, inputs, tokens)
    encoded = None if inputs is None else model.apply(variables, inputs,
                                                      method=Transformer.encode)
    cache = init_cache(cfg, 2, 6)
    steps = []
    for position, token in enumerate(shift_right(tokens).T):
        logits, cache = model.apply(variables, encoded, inputs, token[:, None], cache=cache,
                                    method=Transformer.decode)
        steps.append(logits[:, 0])
        assert int(cache["index"]) == position + 1
    np.testing.assert_allclose(np.stack(steps, 1), full, rtol=1e-5, atol=1e-5)
