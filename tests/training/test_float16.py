"""Float16 training: the dynamic loss scale's state machine by hand, overflow steps that leave
params and optimizer state untouched, the float16 curve against float32 on configs/tiny.py,
exact resume with the scale, and float32 logits whatever the compute dtype."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer.config import resolve
from transformer.data import make_source
from transformer.model.transformer import Transformer
from transformer.parallel import sharding
from transformer.training import metrics, optim, train_state

# The float16 and float32 tiny-config losses agree to this relative tolerance over
# CURVE_STEPS steps (measured worst 2.4e-4 over 20 steps, 6.5e-4 over 30 with tiny.py's two
# layers a side; 1.6e-4 and 2.6e-4 with the one of `tiny` below: float16 rounds to
# 2**-11 = 4.9e-4 relative; bfloat16, 2**-8, differs from float32 by up to 8.4e-4 there, 7.2e-4
# with one layer).
CURVE_RTOL = 2e-3
CURVE_STEPS = 20


@pytest.fixture(scope="module")
def tiny(load_config):
    """configs/tiny.py with 16 rows a batch and one layer each side (half the compiling of its
    two; every kind of block is there), in float16 unless overridden."""
    return lambda **overrides: load_config(
        "tiny.py", **{"data.batch_size": 16, "model.dtype": "float16",
                      "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
                      **overrides})


class OneDevice:
    """A config's trainer, jitted train step and data on one device, built once."""

    def __init__(self, cfg):
        self.mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
        run = resolve(cfg, 1)
        self.seed = cfg.seed
        self.trainer = train_state.build_trainer(run, self.mesh)
        self.step_fn = train_state.make_train_step(self.trainer, run.config)
        self.source = make_source(cfg)

    def init(self):
        return train_state.init_state(self.trainer, self.seed)

    def run(self, num_steps, state=None, first_batch=0):
        """(state, [metrics per step]) of `num_steps` steps from `state` (None: a fresh one)."""
        state = self.init() if state is None else state
        fetched = []
        for index in range(first_batch, first_batch + num_steps):
            batch = self.source.train_batch(index, (0, self.source.rows_per_batch))
            state, metrics = self.step_fn(state, train_state.global_batch(self.mesh, batch))
            fetched.append(jax.device_get(metrics))
        return state, fetched


@pytest.fixture(scope="module")
def float16_tiny(tiny):
    return OneDevice(tiny())


# ---- the state machine --------------------------------------------------------------------------


def scales_after(pattern: str, *, period: int, initial: float) -> list[tuple[float, int, int]]:
    """(scale, finite_steps, overflow_steps) after each step of `pattern` ("f" finite
    gradients, "o" an overflow)."""
    update = jax.jit(optim.update_loss_scale, static_argnums=2)
    state = optim.init_loss_scale(optim.LossScaleConfig(initial, period))
    seen = []
    for outcome in pattern:
        state = update(state, jnp.asarray(outcome == "f"), period)
        seen.append((float(state.scale), int(state.finite_steps), int(state.overflow_steps)))
    return seen


def test_loss_scale_follows_hand_worked_sequences():
    # Period 3 from 2**15: the third finite step in a row doubles; an overflow halves and
    # restarts the count.
    assert scales_after("fffoffffof", period=3, initial=2.0**15) == [
        (2.0**15, 1, 0), (2.0**15, 2, 0), (2.0**16, 0, 0),  # doubled at the 3rd
        (2.0**15, 0, 1),  # overflow: halved
        (2.0**15, 1, 1), (2.0**15, 2, 1), (2.0**16, 0, 1), (2.0**16, 1, 1),
        (2.0**15, 0, 2),  # the count (1 of 3) restarts
        (2.0**15, 1, 2)]
    # Never below 1: overflows at scale 2 and 1 leave 1 and are still counted.
    assert scales_after("ooof", period=2, initial=4.0) == [
        (2.0, 0, 1), (1.0, 0, 2), (1.0, 0, 3), (1.0, 1, 3)]
    # Period 1: every finite step doubles.
    assert [s for s, _, _ in scales_after("ffof", period=1, initial=1.0)] == [2.0, 4.0, 2.0,
                                                                               4.0]


@pytest.mark.parametrize("key,value,message", [
    ("loss_scale_initial", 3.0, "optimizer.loss_scale_initial=3.0 must be a power of two >= 1"),
    ("loss_scale_initial", 0.5, "optimizer.loss_scale_initial=0.5 must be a power of two >= 1"),
    ("loss_scale_initial", float("inf"), "optimizer.loss_scale_initial=inf must be a power"),
    ("loss_scale_period", 0, "optimizer.loss_scale_period=0 must be an int >= 1"),
    ("loss_scale_period", 2.5, "optimizer.loss_scale_period=2.5 must be an int >= 1"),
])
def test_bad_loss_scale_settings_are_one_line_naming_the_key(tiny, key, value, message):
    with pytest.raises(ValueError, match=f"^{message}") as raised:
        resolve(tiny(**{f"optimizer.{key}": value}))
    assert "\n" not in str(raised.value)


def test_loss_scale_defaults_and_settings():
    assert optim.loss_scale_config({}) == optim.LossScaleConfig(2.0**15, 2000)
    assert optim.loss_scale_config({"loss_scale_initial": 2**8, "loss_scale_period": 7}) == (
        optim.LossScaleConfig(256.0, 7))


# ---- the train step -----------------------------------------------------------------------------


def test_overflow_skips_the_update_halves_the_scale_and_stops_at_the_minimum(tiny):
    """A z-loss of 1e30 keeps the float32 loss finite (~1e33) but its gradient overflows
    float16 at any scale. From scale 2: the first step is an overflow that scaling handles
    (skipped, halved, not `nonfinite`); at scale 1 it cannot (`nonfinite`, which stops a run
    unless skip_nonfinite_updates). Neither changes params or optimizer state by one bit; both
    use up their batch (the step advances)."""
    runner = OneDevice(tiny(z_loss=1e30, **{"optimizer.loss_scale_initial": 2}))
    state = runner.init()
    before = jax.device_get((state.params, state.opt_state))
    state, (first, second) = runner.run(2, state)
    assert np.isfinite(first["loss"]) and not np.isfinite(first["grad_norm"])
    assert [float(m["loss_scale"]) for m in (first, second)] == [2.0, 1.0]
    assert [int(m["skipped_overflow_steps"]) for m in (first, second)] == [1, 2]
    assert [bool(m["nonfinite"]) for m in (first, second)] == [False, True]
    assert int(state.step) == 2
    assert state.loss_scale == optim.LossScaleState(1.0, 0, 2)
    assert int(optax.tree.get(state.opt_state, "ScaleByScheduleState").count) == 0
    assert float(second["learning_rate"]) == float(runner.trainer.schedule(0))
    after = jax.device_get((state.params, state.opt_state))
    assert jax.tree.structure(after) == jax.tree.structure(before)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)


def test_float16_curve_matches_float32(tiny, float16_tiny):
    """CURVE_STEPS updates of configs/tiny.py in float16 (loss scale 2**15, no overflow) give
    the float32 losses to CURVE_RTOL; float32 runs carry no loss scale."""
    state16, metrics16 = float16_tiny.run(CURVE_STEPS)
    state32, metrics32 = OneDevice(tiny(**{"model.dtype": "float32"})).run(CURVE_STEPS)
    losses16 = np.array([m["loss"] for m in metrics16])
    losses32 = np.array([m["loss"] for m in metrics32])
    np.testing.assert_allclose(losses16, losses32, rtol=CURVE_RTOL)
    assert losses16[-1] < losses16[0] - 0.5  # it learns
    assert np.abs(losses16 / losses32 - 1).max() > 0  # float16 is not float32 in disguise
    assert {float(m["loss_scale"]) for m in metrics16} == {2.0**15}
    assert int(metrics16[-1]["skipped_overflow_steps"]) == 0
    assert state16.loss_scale.finite_steps == CURVE_STEPS
    assert type(state32) is train_state.TrainState
    assert not set(train_state.LOSS_SCALE_METRICS) & set(metrics32[0])


def test_float16_checkpoint_restores_the_scale_and_continues_exactly(float16_tiny, tmp_path):
    """From a loss scale of 2**18 one finite step short of doubling (period 2000): saved after
    step 1 and restored (its scale and count with it), steps 2-4 give, bit for bit, the losses,
    scales and params of the run that never stopped; step 2 doubles the scale."""
    from transformer.checkpoint.checkpointer import Checkpointer

    runner = float16_tiny
    start = runner.init()
    start = start.replace(loss_scale=jax.device_put(optim.LossScaleState(
        np.float32(2.0**18), np.int32(1998), np.int32(5)),
        runner.trainer.state_shardings.loss_scale))
    saved, _ = runner.run(1, state=jax.tree.map(jnp.copy, start))
    assert saved.loss_scale == optim.LossScaleState(2.0**18, 1999, 5)
    checkpointer = Checkpointer(str(tmp_path), keep=2)
    checkpointer.save(1, saved, {"next_batch_index": 1})
    checkpointer.close()
    restored, data_state = Checkpointer(str(tmp_path), keep=2).restore(
        1, runner.trainer.abstract_state)
    assert data_state == {"next_batch_index": 1}
    assert restored.loss_scale == saved.loss_scale
    resumed, resumed_metrics = runner.run(3, state=restored, first_batch=1)
    straight, straight_metrics = runner.run(4, state=start)

    def figures(metrics):
        return [(float(m["loss"]), float(m["loss_scale"]), int(m["skipped_overflow_steps"]))
                for m in metrics]

    assert figures(resumed_metrics) == figures(straight_metrics[1:])
    assert figures(straight_metrics)[1][1:] == (2.0**18, 5)
    assert figures(straight_metrics)[2][1] == 2.0**19  # doubled by step 2
    for a, b in zip(jax.tree.leaves(jax.device_get(straight)),
                    jax.tree.leaves(jax.device_get(resumed)), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_float16_run_logs_the_scale_and_resumes_exactly(tiny, tmp_path):
    """train.py's loop from scale 2**20 (tiny overflows above ~2**18) with period 2: every
    train line carries the scale the step used and the running count of overflow-skipped
    updates, as the state machine gives them; overflows do not stop the run; stopped at
    step 4 and resumed from its checkpoint, it logs bit for bit the lines of the run that
    never stopped."""
    from transformer.training import loop

    def cfg(steps):
        return tiny(num_train_steps=steps, eval_every_steps=0, log_every_steps=1,
                    checkpoint_every_steps=4, **{"optimizer.loss_scale_initial": 2**20,
                                                 "optimizer.loss_scale_period": 2})

    def lines(workdir):
        found = {}
        for line in (workdir / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["split"] == "train":
                found[record["step"]] = [record[k] for k in ("loss", "grad_norm",
                                                             *train_state.LOSS_SCALE_METRICS)]
        return found

    straight = loop.train_and_evaluate(cfg(7), str(tmp_path / "straight"))
    loop.train_and_evaluate(cfg(4), str(tmp_path / "resumed"))
    resumed = loop.train_and_evaluate(cfg(7), str(tmp_path / "resumed"))
    expected = lines(tmp_path / "straight")
    assert lines(tmp_path / "resumed") == expected
    assert resumed.loss_scale == straight.loss_scale and int(resumed.step) == 7

    skipped = [0] + [expected[s][3] for s in range(1, 8)]
    pattern = "".join("o" if grew else "f" for grew in np.diff(skipped))
    assert pattern.startswith("oo") and "ff" in pattern  # 2**20 and 2**19 overflow
    states = [(2.0**20, 0, 0)] + scales_after(pattern, period=2, initial=2.0**20)
    assert [expected[s][2] for s in range(1, 8)] == [scale for scale, _, _ in states[:7]]
    assert straight.loss_scale == optim.LossScaleState(*states[7])


def test_progress_line_shows_the_loss_scale():
    values = {"loss": 2.0, "learning_rate": 1e-3, "tokens_per_sec": 10.0,
              "data_wait_fraction": 0.0, "loss_scale": np.float32(2.0**15),
              "skipped_overflow_steps": np.int32(3)}
    assert metrics.format_progress(5, 10, values).endswith(
        " | loss scale 32768 (3 overflows skipped)")
    del values["loss_scale"], values["skipped_overflow_steps"]
    assert "loss scale" not in metrics.format_progress(5, 10, values)


# ---- float32 logits -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_logits_are_float32_whatever_the_compute_dtype(tiny, dtype):
    """The output projection accumulates in float32 (not logits rounded to the compute dtype):
    the logits equal the float32 product of the hidden states and kernel that the compute
    dtype gave, to float32 rounding."""
    model = Transformer(resolve(tiny(**{"model.dtype": dtype})).model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 32, size=(2, 7)), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens, tokens)["params"]
    logits, head = jax.jit(lambda p: (
        model.apply({"params": p}, tokens, tokens),
        model.apply({"params": p}, tokens, tokens, method="output_head")))(params)
    assert logits.dtype == jnp.float32 and head.hidden.dtype == jnp.dtype(dtype)
    expected = np.einsum("btd,vd->btv", np.asarray(head.hidden, np.float32),
                         np.asarray(head.kernel, np.float32))
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
