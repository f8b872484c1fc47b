"""Faults while training: damaged checkpoints, a full disk while saving, a kill in the middle of
a save, and repeated kills (SIGKILL and SIGTERM) at seeded random moments of `train.py`."""

import itertools
import json
import logging
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import checkpoint, checkpoint_hooks
from transformer.checkpoint import Checkpointer, CheckpointSaveError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def tree(step: int, width: int = 8) -> dict:
    return {"step": jnp.asarray(step, jnp.int32),
            "params": {"dense": {"kernel": jax.random.normal(jax.random.key(step), (width, 3)),
                                 "bias": jnp.arange(3.0) + step}}}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


def save_steps(workdir, steps, width: int = 8) -> None:
    checkpointer = Checkpointer(str(workdir), keep=5)
    for step in steps:
        checkpointer.save(step, tree(step, width), {"next_batch_index": step})
    checkpointer.close()


def files_of(workdir) -> dict[str, bytes]:
    return {str(p.relative_to(workdir)): p.read_bytes()
            for p in sorted(pathlib.Path(workdir).rglob("*")) if p.is_file()}


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 8] = b"\xff\x00garbag"
    path.write_bytes(bytes(data))


DAMAGE = {  # file in checkpoints/<step>/ -> damage, as a disk or an interrupted copy leaves it
    "truncated state manifest": ("state/manifest.ocdbt", truncate),
    "garbled state metadata": ("state/_METADATA", garbage),
    "truncated array metadata": ("state/array_metadatas/process_0", truncate),
    "garbled data item": ("data/metadata", garbage),
    "deleted data item": ("data/metadata", os.remove),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_latest_checkpoint_is_skipped_for_the_previous_one(tmp_path, kind, caplog):
    save_steps(tmp_path, [1, 2])
    name, damage = DAMAGE[kind]
    damage(tmp_path / "checkpoints" / "2" / name)
    damaged = files_of(tmp_path / "checkpoints" / "2")
    checkpointer = Checkpointer(str(tmp_path), keep=5)
    with caplog.at_level(logging.WARNING, logger="transformer"):
        step, state, data_state = checkpointer.restore_latest(abstract(tree(0)))
    assert (step, data_state) == (1, {"next_batch_index": 1})
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(tree(1)), strict=True):
        np.testing.assert_array_equal(got, want)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("checkpoint 2 does not restore (") and "\n" not in warning
    assert f"moved to {tmp_path / 'skipped_checkpoints' / '2'}" in warning
    # Nothing is lost: the damaged step is kept, byte for byte, beside the checkpoints.
    assert files_of(tmp_path / "skipped_checkpoints" / "2") == damaged
    assert checkpointer.all_steps() == [1]
    checkpointer.save(2, tree(2), {"next_batch_index": 2})  # training goes on past it
    checkpointer.close()
    assert checkpoint.list_steps(str(tmp_path / "checkpoints")) == [1, 2]


def test_bytes_changed_inside_array_data_are_never_restored_silently(tmp_path, caplog):
    # Orbax keeps no checksum of array data: a garbled chunk can read back as other numbers.
    # The checksums saved in the data item catch it.
    save_steps(tmp_path, [1], width=400)  # a kernel of 1,200 random floats
    chunks = sorted((tmp_path / "checkpoints" / "1" / "state").rglob("d/*"))
    assert chunks
    outcomes = set()
    for chunk in chunks:
        shutil.rmtree(tmp_path / "checkpoints" / "2", ignore_errors=True)
        shutil.copytree(tmp_path / "checkpoints" / "1", tmp_path / "checkpoints" / "2")
        garbage(tmp_path / "checkpoints" / "2" / chunk.relative_to(
            tmp_path / "checkpoints" / "1"))
        checkpointer = Checkpointer(str(tmp_path), keep=5)
        with caplog.at_level(logging.WARNING, logger="transformer"):
            step, state, _ = checkpointer.restore_latest(abstract(tree(0, width=400)))
        checkpointer.close()
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(tree(1, 400)), strict=True):
            np.testing.assert_array_equal(got, want)  # the copy of step 1, or step 1 itself
        outcomes.add("harmless" if step == 2 else "skipped")
    assert "skipped" in outcomes
    assert "ValueError: params/dense/kernel does not match the checksum saved with it" in \
        caplog.text


def test_checksums_are_the_same_on_any_mesh():
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    state = tree(3, width=8)
    sharded = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(
        mesh, jax.P("a") if x.ndim == 2 else jax.P())), state)
    assert len(sharded["params"]["dense"]["kernel"].sharding.device_set) == 8
    assert checkpoint.checksums(sharded) == checkpoint.checksums(state)
    changed = jax.tree.map(lambda x: x, state)
    kernel = state["params"]["dense"]["kernel"]  # the second leaf: bias, kernel, step
    changed["params"]["dense"]["kernel"] = kernel.at[5, 1].set(jnp.nextafter(kernel[5, 1], 9))
    before, after = checkpoint.checksums(state), checkpoint.checksums(changed)
    assert after[0] == before[0] and after[1] != before[1] and after[2] == before[2]


def test_when_no_checkpoint_restores_the_error_lists_each_and_why(tmp_path):
    save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        truncate(tmp_path / "checkpoints" / str(step) / "state" / "manifest.ocdbt")
    with pytest.raises(ValueError) as error:
        Checkpointer(str(tmp_path), keep=5).restore_latest(abstract(tree(0)))
    message = str(error.value)
    assert message.startswith(f"no checkpoint in {tmp_path / 'checkpoints'} restores: 2 (")
    assert "; 1 (" in message and "new --workdir" in message and "\n" not in message
    assert sorted(os.listdir(tmp_path / "skipped_checkpoints")) == ["1", "2"]


def test_a_checkpoint_with_other_shapes_names_the_parameter_and_both_shapes(tmp_path):
    save_steps(tmp_path, [1])
    before = files_of(tmp_path)
    with pytest.raises(ValueError) as error:
        Checkpointer(str(tmp_path), keep=5).restore_latest(abstract(tree(0, width=16)))
    assert str(error.value) == (
        f"checkpoint 1 in {tmp_path / 'checkpoints'} holds params/dense/kernel with shape (8, 3)"
        f" but the config gives (16, 3): resume with the config it was trained with (its "
        f"config.json) or use a new --workdir")
    assert files_of(tmp_path) == before  # not mistaken for damage: nothing moved
    fewer = abstract(tree(0))
    del fewer["params"]["dense"]["bias"]
    with pytest.raises(ValueError, match=r"checkpoint 1 in .* holds params/dense/bias \(3,\), "
                                         r"which the config does not have"):
        Checkpointer(str(tmp_path), keep=5).restore_latest(fewer)


def test_a_full_disk_fails_the_save_in_one_line_and_keeps_the_previous_one(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv(checkpoint_hooks.FAULT_ENV, "enospc@2")
    with pytest.raises(CheckpointSaveError) as error:
        save_steps(tmp_path, [1, 2])
    assert str(error.value) == (
        f"disk full while saving checkpoint 2 in {tmp_path / 'checkpoints'}; free space (or use "
        f"another --workdir) and rerun to resume: checkpoint 1 is intact")
    assert isinstance(error.value, ValueError)  # what train.py reports as `error: ...`
    monkeypatch.delenv(checkpoint_hooks.FAULT_ENV)
    step, state, _ = Checkpointer(str(tmp_path), keep=5).restore_latest(abstract(tree(0)))
    assert step == 1
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(tree(1)), strict=True):
        np.testing.assert_array_equal(got, want)
    assert os.listdir(tmp_path / "checkpoints") == ["1"]  # the unfinished save was removed


def test_the_fault_injection_setting_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv(checkpoint_hooks.FAULT_ENV, "explode@3")
    with pytest.raises(ValueError, match="expected kill@<step> or enospc@<step>"):
        Checkpointer(str(tmp_path), keep=1)


# --------------------------------------------------------------------------- train.py processes

_RUNS = itertools.count()
TOTAL, EVERY = 40, 5  # steps, and a checkpoint every EVERY steps
COMMON = ["--config=configs/tiny.py", "--config.log_every_steps=1", "--config.eval_every_steps=0",
          "--config.data.batch_size=16", f"--config.num_train_steps={TOTAL}",
          f"--config.checkpoint_every_steps={EVERY}", "--config.keep_checkpoints=2"]


def start(workdir, fault=None) -> subprocess.Popen:
    """train.py on the tiny config with 2 fake devices; output to `<workdir>.<n>.log`."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(ROOT / ".cache" / "jax"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    env.pop(checkpoint_hooks.FAULT_ENV, None)
    if fault:
        env[checkpoint_hooks.FAULT_ENV] = fault
    log = open(f"{workdir}.{next(_RUNS)}.log", "w")
    process = subprocess.Popen([sys.executable, "train.py", f"--workdir={workdir}", *COMMON],
                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    process.log = pathlib.Path(log.name)
    return process


def train_losses(workdir) -> dict[int, list[float]]:
    """Every train loss logged, per step (a step redone after a kill is logged again)."""
    found: dict[int, list[float]] = {}
    path = pathlib.Path(workdir) / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record["split"] == "train":
            found.setdefault(record["step"], []).append(record["loss"])
    return found


def wait_until_step(process, workdir, step, timeout=300) -> None:
    deadline = time.monotonic() + timeout
    while max(train_losses(workdir), default=0) < step and process.poll() is None:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def assert_params_equal(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its train losses and final parameters."""
    workdir = tmp_path_factory.mktemp("faults") / "reference"
    process = start(workdir)
    assert process.wait(timeout=600) == 0, process.log.read_text()[-3000:]
    return train_losses(workdir), checkpoint.load_params(str(workdir))


@pytest.mark.slow
def test_repeated_kills_at_random_moments_lose_nothing(tmp_path, reference):
    expected, expected_params = reference
    assert sorted(expected) == list(range(1, TOTAL + 1))
    workdir = tmp_path / "killed"
    rng = random.Random(9)
    kills = []
    for _ in range(5):
        done = max(train_losses(workdir), default=0)
        target = min(rng.randint(done + 1, done + EVERY + 2), TOTAL - 3)
        sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
        process = start(workdir)
        wait_until_step(process, workdir, target)
        process.send_signal(sig)
        code = process.wait(timeout=120)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0), process.log.read_text()
        kills.append((sig.name, max(train_losses(workdir))))
        steps = checkpoint.list_steps(str(workdir / "checkpoints"))
        if sig == signal.SIGTERM:  # it saved the step it stopped at
            assert steps[-1] == kills[-1][1]
        if steps:  # the latest complete checkpoint always restores
            params = checkpoint.load_params(str(workdir), step=steps[-1])
            assert jax.tree.structure(params) == jax.tree.structure(expected_params)
    assert [name for name, _ in kills] == ["SIGTERM", "SIGKILL", "SIGKILL", "SIGTERM", "SIGKILL"]
    # A kill inside an async save: the partial step is never picked.
    done = max(checkpoint.list_steps(str(workdir / "checkpoints")), default=0)
    doomed = (done // EVERY + 1) * EVERY
    process = start(workdir, fault=f"kill@{doomed}")
    assert process.wait(timeout=300) == -signal.SIGKILL, process.log.read_text()[-3000:]
    assert (workdir / "checkpoints" / f"{doomed}.orbax-checkpoint-tmp").is_dir()
    assert doomed not in checkpoint.list_steps(str(workdir / "checkpoints"))
    # Then a full disk at that save: one line, exit status 1, the previous checkpoint intact.
    process = start(workdir, fault=f"enospc@{doomed}")
    assert process.wait(timeout=300) == 1, process.log.read_text()[-3000:]
    output = process.log.read_text()
    assert output.splitlines()[-1] == (
        f"error: disk full while saving checkpoint {doomed} in {workdir / 'checkpoints'}; free "
        f"space (or use another --workdir) and rerun to resume: checkpoint {done} is intact")
    assert "Traceback" not in output
    assert checkpoint.list_steps(str(workdir / "checkpoints"))[-1] == done
    # And the latest complete checkpoint damaged: resume falls back to the one before.
    previous, latest = checkpoint.list_steps(str(workdir / "checkpoints"))[-2:]
    truncate(workdir / "checkpoints" / str(latest) / "state" / "manifest.ocdbt")
    process = start(workdir)
    assert process.wait(timeout=600) == 0, process.log.read_text()[-3000:]
    log = process.log.read_text()
    assert f"checkpoint {latest} does not restore (ValueError: " in log
    assert f"resuming from {workdir / 'checkpoints'}/{previous}" in log
    assert (workdir / "skipped_checkpoints" / str(latest) / "state").is_dir()
    assert "Traceback" not in log

    got = train_losses(workdir)
    assert sorted(got) == sorted(expected)
    redone = {step: losses for step, losses in got.items() if len(losses) > 1}
    assert redone, kills  # some updates were computed again after a kill ...
    for step, losses in got.items():  # ... each time giving the reference's loss exactly
        assert losses == [expected[step][0]] * len(losses), (step, kills)
    assert_params_equal(checkpoint.load_params(str(workdir)), expected_params)
    assert checkpoint.list_steps(str(workdir / "checkpoints"))[-1] == TOTAL


@pytest.mark.slow
def test_a_killed_coordinator_stops_its_peer_and_the_run_resumes_exactly(tmp_path):
    """The dead-peer behaviour (test_multihost.py kills process 1) with process 0, which hosts
    the coordination service, killed instead: the survivor stops once it cannot reach the service,
    the latest checkpoint restores, and the steps redone after the resume give the losses logged
    before, exactly. (Each 2-process start compiles afresh, ~1 min on 2 cores: one kill here.)"""
    from test_multihost import DEAD_PEER_MESSAGE, launch, output_of

    heartbeat, total, target = 5, 12, 5
    overrides = ["--config.eval_every_steps=0", f"--config.num_train_steps={total}",
                 f"--config.distributed.heartbeat_timeout_seconds={heartbeat}",
                 "--config.checkpoint_every_steps=3"]
    procs = launch(tmp_path, processes=2, devices=4, overrides=overrides)
    deadline = time.monotonic() + 600
    while max(train_losses(tmp_path), default=0) < target:
        assert all(p.poll() is None for p in procs), output_of(procs[1])[-3000:]
        assert time.monotonic() < deadline, "training did not reach the target step"
        time.sleep(0.05)
    procs[0].send_signal(signal.SIGKILL)
    # Event-based: the survivor ends on losing the coordination service, which process 0 hosted,
    # not on a collective's timeout or an unrelated error. Measured (2 shared cores): it exits
    # in the same second as its step-5 line, well before the 5 s heartbeat timeout; the wait's
    # limit only turns a hang into a failure.
    procs[1].wait(timeout=heartbeat + 60)
    survivor = output_of(procs[1])
    assert procs[1].returncode != 0
    assert DEAD_PEER_MESSAGE in survivor, survivor[-3000:]
    assert "Failed to send RPC to coordination service" in survivor, survivor[-3000:]
    procs[0].wait()
    steps = checkpoint.list_steps(str(tmp_path / "checkpoints"))
    assert steps[-1] >= 3
    checkpoint.load_params(str(tmp_path), step=steps[-1])  # the latest complete one restores
    procs = launch(tmp_path, processes=2, devices=4, overrides=overrides)
    for p in procs:
        assert p.wait(timeout=600) == 0, output_of(p)[-3000:]
    assert f"resuming from {tmp_path / 'checkpoints'}/{steps[-1]}" in output_of(procs[0])
    got = train_losses(tmp_path)
    assert sorted(got) == list(range(1, total + 1))
    assert any(len(losses) > 1 for losses in got.values())  # steps were redone ...
    assert all(len(set(losses)) == 1 for losses in got.values())  # ... identically
