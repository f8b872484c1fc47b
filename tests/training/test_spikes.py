"""Loss-spike skipping (optimizer.skip_spikes, training/spikes.py): the rolling z-score, the
skipped update bit-identical to none, the window surviving a checkpoint, the stop after K in a
row, on a 2 x 4 mesh with accumulation and float16 loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.checkpoint import faults
from transformer.checkpoint.checkpointer import Checkpointer
from transformer.config import SpikeConfig, resolve
from transformer.data import make_source
from transformer.parallel import sharding
from transformer.training import loop, spikes, train_state


@pytest.fixture(scope="module")
def spike_config(load_config):
    """configs/tiny.py with one layer a side (quicker to compile), 16 rows a batch, spike
    skipping on (window 4, 3 sigma, 2 in a row), and overrides."""
    return lambda **overrides: load_config("tiny.py", **{
        "data.batch_size": 16, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
        "optimizer.skip_spikes": True, "optimizer.spike_window": 4,
        "optimizer.spike_threshold": 3.0, "optimizer.max_skipped_in_a_row": 2, **overrides})


def setup(cfg, shape=(1, 1, 1)):
    """(trainer, jitted step, batch 0, fresh state) on a data x fsdp x tensor mesh."""
    num = int(np.prod(shape))
    mesh = sharding.make_mesh({"data": shape[0], "fsdp": shape[1], "tensor": shape[2]},
                              jax.devices()[:num])
    resolved = resolve(cfg, num)
    trainer = train_state.build_trainer(resolved, mesh)
    step_fn = train_state.make_train_step(trainer, resolved.config)
    source = make_source(cfg)
    rows = train_state.process_rows(mesh, source.rows_per_batch)
    batch = train_state.global_batch(mesh, source.train_batch(0, rows))
    return trainer, step_fn, batch, train_state.init_state(trainer, cfg.seed)


def with_window(state, losses, grad_norms, in_a_row=0):
    """`state` whose spike window is full of these values."""
    window = spikes.SpikeWindow(
        losses=jnp.asarray(losses, jnp.float32), grad_norms=jnp.asarray(grad_norms, jnp.float32),
        count=jnp.asarray(len(losses), jnp.int32), in_a_row=jnp.asarray(in_a_row, jnp.int32),
        skipped=jnp.asarray(in_a_row, jnp.int32))
    return state.replace(spikes=jax.device_put(window, state.step.sharding))


# A window the fresh tiny model's first step (loss ~4.0, gradient norm ~2.3) is far above:
# mean 1.0, std 0.0071: z ~ 400. And one it is far below.
CALM = ([1.0, 1.01, 0.99, 1.0], [0.5, 0.51, 0.49, 0.5])
STORMY = ([10.0, 11.0, 9.0, 10.0], [50.0, 55.0, 45.0, 50.0])


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_identical(a, b):
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_judge_is_a_one_sided_rolling_z_score_as_numpy_computes_it():
    """Random windows against numpy's mean and population std: a value is a spike when it is
    more than `threshold` deviations above the mean, for the loss or the gradient norm; a
    window not yet full judges nothing; an applied value fills slot count % window."""
    config = SpikeConfig(window=5, threshold=2.0, max_in_a_row=3)
    rng = np.random.default_rng(0)
    for _ in range(20):
        losses, norms = rng.normal(3.0, 0.2, 5), rng.normal(1.0, 0.1, 5)
        loss, norm = rng.normal(3.3, 0.3), rng.normal(1.1, 0.15)
        expected = ((loss - losses.mean()) / losses.std() > 2.0
                    or (norm - norms.mean()) / norms.std() > 2.0)
        window = spikes.SpikeWindow(jnp.asarray(losses, jnp.float32),
                                    jnp.asarray(norms, jnp.float32), jnp.int32(7),
                                    jnp.int32(0), jnp.int32(0))
        spike, after = spikes.judge(window, config, jnp.float32(loss), jnp.float32(norm),
                                    jnp.bool_(True))
        assert bool(spike) == expected
        if not expected:
            assert float(after.losses[7 % 5]) == np.float32(loss) and int(after.count) == 8
    not_full = spikes.SpikeWindow(jnp.ones(5), jnp.ones(5), jnp.int32(4), jnp.int32(0),
                                  jnp.int32(0))
    assert not bool(spikes.judge(not_full, config, jnp.float32(1e9), jnp.float32(1e9),
                                 jnp.bool_(True))[0])


def test_a_spike_is_skipped_bit_identically_and_counted(spike_config):
    cfg = spike_config()
    trainer, step_fn, batch, fresh = setup(cfg)
    before = with_window(fresh, *CALM)
    expected = jax.device_get(before)
    after, metrics = step_fn(before, batch)
    assert bool(metrics["spike_skipped"]) and not bool(metrics["nonfinite"])
    assert int(metrics["skipped_updates"]) == 1 and int(metrics["spikes_in_a_row"]) == 1
    assert not bool(metrics["spike_stop"])
    assert_identical(after.params, expected.params)
    assert_identical(after.opt_state, expected.opt_state)
    assert_identical(after.spikes.losses, expected.spikes.losses)  # the spike is not recorded
    assert int(after.step) == 1

    # The same step under a window it is not far above is applied, and recorded: the params
    # of the step with skipping off
    applied, metrics = step_fn(with_window(train_state.init_state(trainer, cfg.seed),
                                           *STORMY), batch)
    assert not bool(metrics["spike_skipped"]) and int(metrics["skipped_updates"]) == 0
    assert float(applied.spikes.losses[0]) == float(metrics["loss"])
    _, plain_step, _, plain_state = setup(spike_config(**{"optimizer.skip_spikes": False}))
    reference, _ = plain_step(plain_state, batch)
    assert not isinstance(plain_state, train_state.SpikeTrainState)
    assert_identical(applied.params, reference.params)


def test_spikes_are_skipped_on_a_2x4_mesh_with_accumulation_in_float16(spike_config):
    """A spike is skipped bit-identically however the step is split; an update that is not
    one is applied."""
    cfg = spike_config(**{"grad_accum_steps": 2, "model.dtype": "float16"})
    trainer, step_fn, batch, fresh = setup(cfg, (2, 4, 1))  # data 2 x fsdp 4
    expected = jax.device_get(fresh)
    skipped, metrics = step_fn(with_window(fresh, *CALM), batch)
    assert bool(metrics["spike_skipped"]) and not bool(metrics["nonfinite"])
    assert_identical(skipped.params, expected.params)
    assert_identical(skipped.opt_state, expected.opt_state)
    # a spike is not an overflow: the loss scale stays
    assert int(metrics["skipped_overflow_steps"]) == 0
    assert float(skipped.loss_scale.scale) == float(expected.loss_scale.scale)

    applied, metrics = step_fn(with_window(train_state.init_state(trainer, cfg.seed),
                                           *STORMY), batch)
    assert not bool(metrics["spike_skipped"]) and not bool(metrics["nonfinite"])
    assert any((x != y).any() for x, y in zip(leaves(applied.params), leaves(expected.params),
                                              strict=True))


def test_the_window_survives_a_checkpoint_and_decides_alike(spike_config, tmp_path):
    cfg = spike_config()
    trainer, step_fn, batch, fresh = setup(cfg)
    state = with_window(fresh, *CALM, in_a_row=1)
    checkpointer = Checkpointer(str(tmp_path), keep=1, use_async=False)
    checkpointer.save(1, state, {"next_batch_index": 1})
    checkpointer.close()
    _, restored, _ = Checkpointer(str(tmp_path), keep=1).restore_latest(trainer.abstract_state)
    assert isinstance(restored, train_state.SpikeTrainState)
    assert_identical(restored.spikes, state.spikes)
    after, metrics = step_fn(restored, batch)
    again, expected = step_fn(state, batch)
    assert bool(metrics["spike_stop"]) and bool(expected["spike_stop"])  # the 2nd in a row
    assert_identical(after, again)


def test_turning_skip_spikes_on_resumes_a_checkpoint_without_a_window(spike_config, tmp_path):
    """A run that switches optimizer.skip_spikes on restores its checkpoint (written without a
    window) whole and starts an empty window; one that keeps it off restores as before."""
    plain_cfg = spike_config(**{"optimizer.skip_spikes": False})
    plain, _, _, _ = setup(plain_cfg)
    state = train_state.init_state(plain, plain_cfg.seed)
    checkpointer = Checkpointer(str(tmp_path), keep=1, use_async=False)
    checkpointer.save(3, state, {"next_batch_index": 3})
    trainer = train_state.build_trainer(resolve(spike_config(), 1), plain.mesh)
    step, restored, data = loop._restore(checkpointer, trainer)
    assert (step, data["next_batch_index"]) == (3, 3)
    assert isinstance(restored, train_state.SpikeTrainState)
    assert_identical(restored.params, state.params)
    assert_identical(restored.opt_state, state.opt_state)
    assert int(restored.spikes.count) == 0 and restored.spikes.losses.shape == (4,)
    assert type(loop._restore(checkpointer, plain)[1]) is train_state.TrainState
    checkpointer.close()


def test_k_spikes_in_a_row_stop_the_run_naming_the_steps(spike_config):
    """The second spike in a row (max_skipped_in_a_row=2) sets spike_stop; later steps apply
    nothing even when they are not spikes; the loop's line names the steps."""
    cfg = spike_config()
    _, step_fn, batch, fresh = setup(cfg)
    expected = jax.device_get(fresh)
    state, first = step_fn(with_window(fresh, *CALM), batch)
    assert not bool(first["spike_stop"])
    state, second = step_fn(state, batch)
    assert bool(second["spike_stop"]) and int(second["spikes_in_a_row"]) == 2
    state = state.replace(spikes=state.spikes.replace(  # a window this step is no spike for
        losses=jnp.asarray(STORMY[0]), grad_norms=jnp.asarray(STORMY[1])))
    state, third = step_fn(state, batch)
    assert bool(third["spike_skipped"])  # stopped: no update is applied any more
    assert_identical(state.params, expected.params)

    pending = [(s, jax.device_get(m)) for s, m in ((7, first), (8, second), (9, third))]
    with pytest.raises(loop.LossSpikes, match=r"^steps 7\.\.8: 2 updates in a row skipped as "
                                              r"loss spikes .* none applied since step 6\. "
                                              r"Last good checkpoint: checkpoint 5\."):
        loop._flush(pending, _Progress(), _Lines(), 9, 10, 1.0, None, cfg, 5)


class _Progress:
    unit = "tok"

    def add_tokens(self, tokens):
        pass

    def report(self, step):
        return {"tokens_per_sec": 1.0, "steps_per_sec": 1.0, "data_wait_fraction": 0.0}


class _Lines:
    def __init__(self):
        self.lines = []

    def write(self, step, split, values):
        self.lines.append((step, split, values))


@pytest.mark.parametrize("key,value,message", [
    ("spike_threshold", 0.0, r"optimizer\.spike_threshold=0\.0 must be > 0"),
    ("spike_threshold", -1, r"optimizer\.spike_threshold=-1(\.0)? must be > 0"),
    ("spike_window", 1, r"optimizer\.spike_window=1 must be an int >= 2"),
    ("max_skipped_in_a_row", 0, r"optimizer\.max_skipped_in_a_row=0 must be an int >= 1"),
])
def test_bad_spike_settings_are_one_line(spike_config, key, value, message):
    with pytest.raises(ValueError, match=message):
        resolve(spike_config(**{f"optimizer.{key}": value}), 1)


def run_steps(step_fn, state, batch, count):
    """`count` steps on `batch`: the states after each (fetched) and their metrics."""
    states, logged = [], []
    for _ in range(count):
        state, metrics = step_fn(state, batch)
        states.append(jax.device_get(state))
        logged.append(jax.device_get(metrics))
    return states, logged


def test_an_injected_spike_is_skipped_with_skipping_on_and_applied_with_it_off(spike_config):
    """`spike@N` (faults.injected_spikes) multiplies update N's loss by 1e3 inside the step: with
    skip_spikes on (window 4, filled by updates 1-4) update 5 is skipped bit-identically; with it
    off update 6 is applied and its loss jumps."""
    cfg = spike_config()
    trainer, _, batch, fresh = setup(cfg)
    on = train_state.make_train_step(trainer, cfg, faults.Spikes(steps=(5,)))
    on_states, on_metrics = run_steps(on, fresh, batch, 5)
    assert [bool(m["spike_skipped"]) for m in on_metrics] == [False] * 4 + [True]
    assert_identical(on_states[4].params, on_states[3].params)
    assert_identical(on_states[4].opt_state, on_states[3].opt_state)

    off_cfg = spike_config(**{"optimizer.skip_spikes": False})
    plain, _, _, plain_fresh = setup(off_cfg)
    off = train_state.make_train_step(plain, off_cfg, faults.Spikes(steps=(6,), factor=1e3))
    off_states, off_metrics = run_steps(off, plain_fresh, batch, 6)
    losses = [float(m["loss"]) for m in off_metrics]
    # Update 5 unspiked here, spiked in the run above from the same parameters: the factor
    # scales the logged loss (float32: a few roundings of 6e-8 each, and the two programs'
    # fusions may sum in other orders: rtol 1e-5)
    np.testing.assert_allclose(float(on_metrics[4]["loss"]), 1e3 * losses[4], rtol=1e-5)
    assert losses[5] > 100 * losses[4] and not bool(off_metrics[5]["nonfinite"])
    norms = [float(m["grad_norm"]) for m in off_metrics]  # the gradient spikes with the loss
    assert norms[5] > 100 * max(norms[:5])
    assert any((x != y).any() for x, y in zip(leaves(off_states[5].params),
                                              leaves(off_states[4].params), strict=True))


def test_the_spike_fault_setting_is_parsed_and_checked(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "spike@5,9*100;kill@7")
    assert faults.injected_spikes() == faults.Spikes(steps=(5, 9), factor=100.0)
    assert faults.injected_fault() == ("kill", 7)
    monkeypatch.setenv(faults.FAULT_ENV, "spike@12")
    assert faults.injected_spikes() == faults.Spikes(steps=(12,), factor=1e3)
    assert faults.injected_fault() is None and faults.fault_injecting_path_class() is None
    monkeypatch.delenv(faults.FAULT_ENV)
    assert faults.injected_spikes() is None
    for bad in ("spike@", "spike@5*x", "kill@5,6", "error@3;kill@4", "spike@1;spike@2"):
        monkeypatch.setenv(faults.FAULT_ENV, bad)
        with pytest.raises(ValueError, match="expected kill@<step>|one of kill"):
            faults.injected_spikes()
