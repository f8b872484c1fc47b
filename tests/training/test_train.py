"""The training engine on 8 fake CPU devices: meshes agree, shardings follow the rules,
gradient accumulation equals the large batch, checkpoints restore onto other meshes."""

import json
import pathlib

import flax
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from transformer.checkpoint.checkpointer import Checkpointer
from transformer.config import resolve
from transformer.data import make_source
from transformer.parallel import sharding
from transformer.training import train_state

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_config(load_config):
    """configs/tiny.py with 16 rows a batch and one layer each side (every kind of block:
    self-attention, cross-attention, feed-forward; half the compiling of two), and overrides."""
    return lambda **overrides: load_config("tiny.py", **{
        "data.batch_size": 16, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
        **overrides})


# Width 32: the tests of what happens to a non-finite update (skipped, stopped, resumed) hold
# at any size.
SMALL = {"model.d_model": 32, "model.d_ff": 64}


def trainer_for(cfg, mesh) -> train_state.Trainer:
    return train_state.build_trainer(resolve(cfg, mesh.size), mesh)


def mesh_of(shape, num_devices=8):
    cfg = {"data": shape[0], "fsdp": shape[1], "tensor": shape[2]}
    return sharding.make_mesh(cfg, jax.devices()[:num_devices])


def run(cfg, mesh, num_steps, state=None, first_batch=0):
    """(final state, per-step losses) of `num_steps` train steps on `mesh`."""
    trainer = trainer_for(cfg, mesh)
    if state is None:
        state = train_state.init_state(trainer, cfg.seed)
    step_fn = train_state.make_train_step(trainer, resolve(cfg, mesh.size).config)
    source = make_source(cfg)
    rows = train_state.process_rows(mesh, source.rows_per_batch)
    losses = []
    for index in range(first_batch, first_batch + num_steps):
        batch = train_state.global_batch(mesh, source.train_batch(index, rows))
        state, metrics = step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return state, np.array(losses), trainer


def assert_params_close(expected, actual, *, max_key_bias_drift):
    """Parameters equal to float32 rounding, except the key biases.

    Softmax ignores a shift shared by all keys, so the key-bias gradient is rounding noise,
    which Adam (eps 1e-9) turns into steps of +-lr whose signs depend on the reduction order.
    """
    expected = flax.traverse_util.flatten_dict(jax.device_get(expected), sep="/")
    actual = flax.traverse_util.flatten_dict(jax.device_get(actual), sep="/")
    assert expected.keys() == actual.keys()
    for path, value in expected.items():
        if path.endswith("key/bias"):
            assert np.abs(value - actual[path]).max() <= max_key_bias_drift + 1e-7, path
        else:
            np.testing.assert_allclose(actual[path], value, rtol=1e-4, atol=1e-6, err_msg=path)


@pytest.fixture(scope="module")
def reference(tiny_config):
    """10 steps on one device: the figures every mesh must reproduce."""
    cfg = tiny_config()
    state, losses, _ = run(cfg, mesh_of((1, 1, 1), 1), 10)
    return cfg, jax.device_get(state), losses


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_meshes_agree_with_one_device(reference, shape):
    cfg, _, expected = reference
    _, losses, _ = run(cfg, mesh_of(shape), 10)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert losses[-1] < losses[0]  # it learns


def test_param_and_optimizer_shardings_follow_rules(tiny_config):
    cfg = tiny_config()
    mesh = mesh_of((2, 2, 2))
    trainer = trainer_for(cfg, mesh)
    state = train_state.init_state(trainer, cfg.seed)
    attn = state.params["encoder"]["layers_0"]["self_attention"]
    assert attn["query"]["kernel"].sharding.spec == P("fsdp", "tensor", None)  # [D, N, H]
    assert attn["out"]["kernel"].sharding.spec == P("tensor", None, "fsdp")  # [N, Hv, D]
    ffn = state.params["encoder"]["layers_0"]["ffn"]
    assert ffn["ff_in"]["kernel"].sharding.spec == P("fsdp", "tensor")  # [D, F]
    assert ffn["ff_out"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert state.params["embedding"]["embedding"].sharding.spec == P("tensor", "fsdp")  # [V, D]
    adam = state.opt_state[1][0]  # clip_by_global_norm, then adam's ScaleByAdamState
    mu = adam.mu["encoder"]["layers_0"]["ffn"]["ff_in"]["kernel"]
    assert mu.sharding.spec == P("fsdp", "tensor")
    # Each device holds 1/4 of ff_in (fsdp 2 x tensor 2), not a replica.
    shard = ffn["ff_in"]["kernel"].addressable_shards[0].data
    assert shard.size * 4 == ffn["ff_in"]["kernel"].size


def test_single_kv_head_is_replicated_under_tensor_parallelism(tiny_config):
    cfg = tiny_config(**{"model.num_kv_heads": 1})
    trainer = trainer_for(cfg, mesh_of((1, 2, 4)))
    key = trainer.state_shardings.params["encoder"]["layers_0"]["self_attention"]["key"]
    assert key["kernel"].spec == P("fsdp", None, None)


def test_params_after_one_step_agree_across_meshes(reference):
    cfg, _, _ = reference
    one, _, _ = run(cfg, mesh_of((1, 1, 1), 1), 1)
    eight, _, _ = run(cfg, mesh_of((2, 2, 2)), 1)
    assert_params_close(one.params, eight.params, max_key_bias_drift=3e-3 / 50)


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 2)])
def test_chunked_loss_trains_as_the_whole_logits(shape, tiny_config):
    """The loss computed one position at a time (loss_chunk_tokens = the rows per device: 13
    chunks; the vocabulary sharded over `tensor` on the 2 x 2 x 2 mesh) gives the losses and
    parameters of the logits held whole."""
    mesh = mesh_of(shape, int(np.prod(shape)))
    whole, whole_losses, _ = run(tiny_config(loss_chunk_tokens=0), mesh, 3)
    rows_per_device = 16 // (shape[0] * shape[1])
    chunked, chunked_losses, trainer = run(tiny_config(loss_chunk_tokens=rows_per_device), mesh,
                                           3)
    assert trainer.loss_chunk_tokens == rows_per_device
    np.testing.assert_allclose(chunked_losses, whole_losses, rtol=1e-5)
    assert_params_close(whole.params, chunked.params, max_key_bias_drift=3 * 3e-3 / 50)


def test_loss_chunks_are_sized_by_backend_unless_set():
    assert train_state.resolve_loss_chunk_tokens(-1) == train_state.AUTO_LOSS_CHUNK_TOKENS["cpu"]
    assert train_state.resolve_loss_chunk_tokens(0) == 0
    assert train_state.resolve_loss_chunk_tokens(96) == 96


def test_gradient_accumulation_equals_large_batch(tiny_config):
    cfg = tiny_config(**{"model.dropout_rate": 0.0})
    mesh = mesh_of((2, 1, 1), 2)
    large, large_losses, _ = run(cfg, mesh, 2)
    cfg.grad_accum_steps = 4
    accumulated, accumulated_losses, _ = run(cfg, mesh, 2)
    np.testing.assert_allclose(accumulated_losses, large_losses, rtol=1e-5)
    assert_params_close(large.params, accumulated.params,
                        max_key_bias_drift=3e-3 / 50 + 6e-3 / 50)  # two updates' learning rates


def test_restore_onto_other_meshes(reference, tmp_path):
    cfg, _, expected = reference
    saved_on = mesh_of((2, 2, 2))
    state, _, _ = run(cfg, saved_on, 5)
    checkpointer = Checkpointer(str(tmp_path), keep=2)
    checkpointer.save(5, state, {"next_batch_index": 5})
    checkpointer.close()
    for shape, devices in (((1, 1, 1), 1), ((1, 2, 4), 8)):
        mesh = mesh_of(shape, devices)
        trainer = trainer_for(cfg, mesh)
        restored, data_state = Checkpointer(str(tmp_path), keep=2).restore(
            5, trainer.abstract_state)
        assert data_state == {"next_batch_index": 5}
        leaf = restored.params["encoder"]["layers_0"]["ffn"]["ff_in"]["kernel"]
        assert leaf.sharding.mesh.shape == mesh.shape
        _, losses, _ = run(cfg, mesh, 5, state=restored, first_batch=5)
        np.testing.assert_allclose(losses, expected[5:], rtol=1e-4)


def test_nonfinite_update_is_not_applied(tiny_config):
    cfg = tiny_config(**SMALL, **{"optimizer.learning_rate": float("inf"),
                                  "optimizer.clip_norm": 0.0})
    mesh = mesh_of((1, 1, 1), 1)
    trainer = trainer_for(cfg, mesh)
    state = train_state.init_state(trainer, cfg.seed)
    before = jax.device_get(state.params)
    step_fn = train_state.make_train_step(trainer, resolve(cfg, 1).config)
    source = make_source(cfg)
    batch = train_state.global_batch(mesh, source.train_batch(0, (0, 16)))
    state, metrics = step_fn(state, batch)  # the update is inf * gradient
    assert bool(metrics["nonfinite"])
    assert int(state.step) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params)),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_every_source_names_the_split_the_loop_evaluates(tiny_config):
    assert make_source(tiny_config()).validation_split == "validation"


def test_eval_batches_cover_each_example_once_whatever_the_process_slices(tiny_config):
    cfg = tiny_config(**{"data.eval_examples": 37})
    source = make_source(cfg)
    whole = [b["inputs"][0] for b in source.eval_batches("validation", (0, 16))]
    halves = [np.concatenate([a["inputs"][0], b["inputs"][0]])
              for a, b in zip(source.eval_batches("validation", (0, 8)),
                              source.eval_batches("validation", (8, 16)), strict=True)]
    np.testing.assert_array_equal(np.concatenate(whole), np.concatenate(halves))
    rows = np.concatenate(whole)
    assert rows.shape[0] == 48  # 3 batches of 16: 37 examples and 11 padding rows
    assert (rows[:37] != 0).any(axis=1).all() and (rows[37:] == 0).all()
    expected = [source.task.example("validation", i)[0] for i in range(37)]
    for row, example in zip(rows[:37], expected, strict=True):
        np.testing.assert_array_equal(row[: len(example)], example)


def test_skipped_update_leaves_the_optimizer_and_the_logged_rate_behind(tiny_config):
    """A skipped update (non-finite) advances only the train step (its batch and dropout key):
    the next update is the optimizer's first, logs the rate it used (the schedule's first,
    not the second), and gives the params of a run that never had the bad step."""
    cfg = tiny_config(**SMALL)
    bad_cfg = tiny_config(**SMALL, **{"optimizer.learning_rate": float("inf")})
    mesh = mesh_of((1, 1, 1), 1)
    trainer = trainer_for(cfg, mesh)
    bad_trainer = trainer_for(bad_cfg, mesh)
    step_fn = train_state.make_train_step(trainer, resolve(cfg, 1).config)
    bad_step_fn = train_state.make_train_step(bad_trainer, resolve(bad_cfg, 1).config)
    source = make_source(cfg)
    batches = [train_state.global_batch(mesh, source.train_batch(i, (0, 16))) for i in (0, 1)]

    state, skipped = bad_step_fn(train_state.init_state(trainer, cfg.seed), batches[0])
    assert bool(skipped["nonfinite"])
    state, applied = step_fn(state, batches[1])
    assert not bool(applied["nonfinite"])
    assert int(state.step) == 2
    count = optax.tree.get(state.opt_state, "ScaleByScheduleState").count
    assert int(count) == 1  # one update applied
    assert float(applied["learning_rate"]) == float(trainer.schedule(0))
    assert float(trainer.schedule(1)) > float(trainer.schedule(0))  # warmup: they differ

    fresh = train_state.init_state(trainer, cfg.seed)
    never_bad, metrics = step_fn(fresh.replace(step=fresh.step + 1), batches[1])
    assert float(metrics["loss"]) == float(applied["loss"])  # the same dropout key
    for a, b in zip(jax.tree.leaves(jax.device_get(never_bad)),
                    jax.tree.leaves(jax.device_get(state)), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_nonfinite_update_stops_the_run_naming_the_step_and_last_checkpoint(tiny_config,
                                                                          tmp_path):
    """Without skip_nonfinite_updates, the first non-finite update ends the run with a line
    naming its step and the last checkpoint, which holds the last good state; resumed with
    it, the run finishes and counts the skips."""
    from transformer.training import loop

    common = {"eval_every_steps": 0, "log_every_steps": 1, "checkpoint_every_steps": 2, **SMALL}
    loop.train_and_evaluate(tiny_config(num_train_steps=2, **common), str(tmp_path))
    bad = tiny_config(num_train_steps=4, **common, **{"optimizer.learning_rate": float("inf")})
    with pytest.raises(loop.NonFiniteLoss, match=r"^step 3: .*Last good checkpoint: "
                                                 r"checkpoint 2\."):
        loop.train_and_evaluate(bad, str(tmp_path))
    assert Checkpointer(str(tmp_path), keep=3).restore_latest(
        trainer_for(bad, mesh_of((8, 1, 1))).abstract_state)[0] == 2

    # With skip_nonfinite_updates the run goes on: each skip is counted on its line, and the
    # optimizer (its count, hence the rate of the next update) stays at the 2 applied updates.
    bad.skip_nonfinite_updates = True
    state = loop.train_and_evaluate(bad, str(tmp_path))
    assert int(state.step) == 4
    assert int(optax.tree.get(state.opt_state, "ScaleByScheduleState").count) == 2
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = {line["step"]: line["nonfinite_skipped"] for line in lines
               if line["split"] == "train"}
    assert skipped == {1: 0, 2: 0, 3: 1, 4: 1}


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads,shape", [(2, (2, 1, 2)), (1, (1, 2, 4))])
def test_tensor_parallel_llama_blocks_train_as_one_device(tiny_config, kv_heads, shape):
    """Grouped-query (2 kv heads over tensor 2) and multi-query attention (1 kv head,
    replicated over tensor 4), SwiGLU, and an untied output projection sharded over the
    vocabulary: 3 steps give the losses and params of one device."""
    cfg = tiny_config(**{"model.num_kv_heads": kv_heads, "model.activation": "swiglu",
                         "model.tie_output_embedding": False, "model.norm_position": "pre",
                         "model.norm": "rms_norm", "model.positional": "rope"})
    one, expected, _ = run(cfg, mesh_of((1, 1, 1), 1), 3)
    sharded, losses, trainer = run(cfg, mesh_of(shape, int(np.prod(shape))), 3)
    logits = trainer.state_shardings.params["decoder"]["logits"]["kernel"].spec
    assert "tensor" in logits  # the vocabulary axis is split
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert losses[-1] < losses[0]
    # Adam moves an element whose gradient is rounding-size by +-lr whichever its sign, so
    # after 3 warmup updates (lr k x 3e-3 / 50) an element may differ by their sum, 3.6e-4;
    # measured worst 2.5e-5 (an ff_gate element). A wrong sharding is off by far more.
    expected_params = flax.traverse_util.flatten_dict(jax.device_get(one.params), sep="/")
    for path, value in flax.traverse_util.flatten_dict(jax.device_get(sharded.params),
                                                       sep="/").items():
        np.testing.assert_allclose(value, expected_params[path], rtol=1e-4,
                                   atol=6 * 3e-3 / 50, err_msg=path)
