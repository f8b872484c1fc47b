"""The local tier of checkpoints (`checkpoint_local_dir`, `transformer/checkpoint/tiers.py`):
restore takes the newest step across both tiers; a wiped or damaged local tier falls back; a run
resumed from a local step continues bit for bit; bad settings are one line each."""

import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST_COMPILE
from ml_collections import ConfigDict

from transformer.checkpoint import faults, tiers
from transformer.training import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tree(step: int) -> dict:
    return {"step": jnp.asarray(step, jnp.int32),
            "params": {"dense": {"kernel": jax.random.normal(jax.random.key(step), (8, 3)),
                                 "bias": jnp.arange(3.0) + step}}}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


def two_tiers(tmp_path, **kwargs) -> tiers.TwoTiers:
    return tiers.TwoTiers(str(tmp_path / "run"), keep=3, local_dir=str(tmp_path / "local"),
                          local_every=1, keep_local=3, **kwargs)


def saved(tmp_path, persistent=(), local=()) -> None:
    checkpoints = two_tiers(tmp_path)
    for step in sorted([*persistent, *local]):
        checkpoints.save(step, tree(step), {"next_batch_index": step},
                         persistent=step in persistent)
    checkpoints.close()


def restored_step(tmp_path) -> int:
    checkpoints = two_tiers(tmp_path)
    step, state, data = checkpoints.restore_latest(abstract(tree(0)))
    checkpoints.close()
    assert data["next_batch_index"] == step
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(tree(step)), strict=True):
        np.testing.assert_array_equal(got, want)  # the bytes saved, exactly
    return step


def test_a_local_step_newer_than_the_persistent_one_is_restored(tmp_path):
    saved(tmp_path, persistent=[2, 4], local=[5, 6])
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2", "4"]
    assert restored_step(tmp_path) == 6
    saved(tmp_path, persistent=[8])  # a persistent step newer than the local ones wins
    assert restored_step(tmp_path) == 8


def test_a_wiped_local_tier_falls_back_to_the_persistent_one(tmp_path):
    saved(tmp_path, persistent=[4], local=[5, 6])
    shutil.rmtree(tmp_path / "local")  # the host lost its disk, or a new host
    assert restored_step(tmp_path) == 4


def test_a_damaged_local_step_is_moved_aside_for_the_one_before(tmp_path, caplog):
    saved(tmp_path, persistent=[4], local=[5, 6])
    manifest = tmp_path / "local" / "6" / "state" / "manifest.ocdbt"
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="transformer"):
        assert restored_step(tmp_path) == 5
    assert any("checkpoint 6 does not restore" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "local" / tiers.SKIPPED / "6" / "state").is_dir()  # kept, moved aside
    # Every local step damaged: the persistent tier's newest restores.
    garble = tmp_path / "local" / "5" / "data" / "metadata"
    garble.write_bytes(b"\xff\x00garbage")
    assert restored_step(tmp_path) == 4


def test_when_no_step_of_either_tier_restores_one_line_lists_each(tmp_path):
    saved(tmp_path, persistent=[4], local=[6])
    for step, where in ((4, tmp_path / "run" / "checkpoints"), (6, tmp_path / "local")):
        (where / str(step) / "data" / "metadata").write_bytes(b"\xff\x00garbage")
    checkpoints = two_tiers(tmp_path)
    listed = r"no checkpoint in .* restores: local 6 \(.*; 4 \("
    with pytest.raises(ValueError, match=listed) as error:
        checkpoints.restore_latest(abstract(tree(0)))
    checkpoints.close()
    assert "\n" not in str(error.value)


def settings(tmp_path, local, every=2, persistent=10, keep=2) -> ConfigDict:
    return ConfigDict({"checkpoint_local_dir": str(local), "checkpoint_local_every_steps": every,
                       "keep_local_checkpoints": keep, "checkpoint_every_steps": persistent})


def test_bad_local_tier_settings_are_one_line_each(tmp_path):
    workdir = str(tmp_path / "run")
    tiers.check_settings(settings(tmp_path, ""), workdir)  # off: nothing checked
    tiers.check_settings(settings(tmp_path, tmp_path / "local"), workdir)
    assert (tmp_path / "local").is_dir()
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o500)
    if os.access(readonly, os.W_OK):  # root writes anyway: sysfs refuses root too
        readonly = pathlib.Path("/sys/transformer-local-tier")
    cases = {
        "is not writable": settings(tmp_path, readonly / "local"),
        "checkpoint_local_every_steps=10 must be smaller than checkpoint_every_steps=10":
            settings(tmp_path, tmp_path / "local", every=10),
        "is inside the workdir's": settings(tmp_path, tmp_path / "run" / "checkpoints" / "l"),
        "checkpoint_local_every_steps=0 must be >= 1": settings(tmp_path, "x", every=0),
        "keep_local_checkpoints=0 must be >= 1": settings(tmp_path, "x", keep=0),
    }
    for message, cfg in cases.items():
        with pytest.raises(ValueError, match=message) as error:
            tiers.check_settings(cfg, workdir)
        assert "\n" not in str(error.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def _losses(workdir) -> dict[int, list[float]]:
    found = {}
    for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == "train":
            found.setdefault(record["step"], []).append(record["loss"])
    return found


def test_a_run_resumed_from_a_local_step_continues_bit_for_bit(load_config, tmp_path,
                                                                monkeypatch):
    overrides = {"data.batch_size": 16, "model.num_encoder_layers": 1, "model.d_model": 32,
                 "model.num_decoder_layers": 1, "num_train_steps": 8, "eval_every_steps": 0,
                 "log_every_steps": 1, "checkpoint_every_steps": 4,
                 "checkpoint_local_every_steps": 2}
    reference = tmp_path / "reference"
    loop.train_and_evaluate(load_config("tiny.py", **overrides | {
        "checkpoint_local_dir": str(tmp_path / "reference_local")}), str(reference))
    expected = _losses(reference)
    assert sorted(expected) == list(range(1, 9))

    cfg = load_config("tiny.py", **overrides | {"checkpoint_local_dir": str(tmp_path / "local")})
    workdir = tmp_path / "run"
    monkeypatch.setenv(faults.FAULT_ENV, "error@7")  # the run stops after update 7
    with pytest.raises(ValueError, match="injected fault after step 7"):
        loop.train_and_evaluate(cfg, str(workdir))
    monkeypatch.delenv(faults.FAULT_ENV)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4"]
    assert sorted(int(s) for s in os.listdir(tmp_path / "local") if s.isdigit()) == [2, 6]
    loop.train_and_evaluate(cfg, str(workdir))  # resumes from local step 6, not from 4
    resumed = _losses(workdir)
    # Each step logged once: 5 and 6 were not computed again (a resume from 4 logs them twice;
    # step 7's line was never written, the fault came before it).
    assert {step: len(v) for step, v in resumed.items()} == {step: 1 for step in range(1, 9)}
    assert resumed == expected  # every loss, bit for bit


def _launch(workdir, local, fault=None) -> list[subprocess.Popen]:
    """train.py on 2 processes of one fake device each over 127.0.0.1 (as
    tests/training/test_multihost.py runs them), the tiny config at one layer of 32, 8 steps, a
    local step every 2 (the last 2 kept), a persistent one every 5; `fault` injected in process
    0 (which finalizes every save)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # none with several processes (test_multihost)
    env.pop(faults.FAULT_ENV, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "train.py", f"--workdir={workdir}", "--config=configs/tiny.py",
               "--config.log_every_steps=1", "--config.data.batch_size=16",
               "--config.eval_every_steps=0", "--config.model.num_encoder_layers=1",
               "--config.model.num_decoder_layers=1", "--config.model.d_model=32",
               "--config.model.d_ff=64", "--config.num_train_steps=8",
               "--config.checkpoint_every_steps=5", f"--config.checkpoint_local_dir={local}",
               "--config.checkpoint_local_every_steps=2",
               f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
    procs = []
    for i in range(2):
        log = open(f"{workdir}-{len(list(workdir.parent.glob('*.log')))}-{i}.log", "w")
        injected = {faults.FAULT_ENV: fault} if fault and i == 0 else {}
        procs.append(subprocess.Popen(command + [f"--process_id={i}"], cwd=ROOT,
                                      env=env | injected, stdout=log, stderr=subprocess.STDOUT))
        procs[-1].log_path = log.name
    return procs


def _steps(directory) -> list[int]:
    return sorted(int(s) for s in os.listdir(directory) if s.isdigit()) \
        if os.path.isdir(directory) else []


@pytest.mark.slow
def test_two_processes_killed_resume_from_the_same_local_step(tmp_path):
    """Process 0 SIGKILLs itself as local step 6 is complete (`killafter@6`), the other is then
    killed: local steps 4 and 6 and persistent 5 are the newest. A new pair resumes: each restores
    local step 6 (the steps that every process holds), and steps up to 6 are not computed
    again."""
    workdir, local = tmp_path / "run", tmp_path / "local"
    procs = _launch(workdir, local, fault="killafter@6")
    assert procs[0].wait(timeout=600) == -signal.SIGKILL, open(procs[0].log_path).read()[-4000:]
    procs[1].kill()
    procs[1].wait()
    # (local step 2 may be left too: the kill comes before the tier drops it)
    assert (_steps(local)[-2:], _steps(workdir / "checkpoints")) == ([4, 6], [5])

    procs = _launch(workdir, local)
    for p in procs:
        assert p.wait(timeout=600) == 0, open(p.log_path).read()[-4000:]
    for p in procs:  # every process restored the same step, from the local tier
        assert "restoring step 6 from the local tier" in open(p.log_path).read()
    logged = _losses(workdir)
    assert sorted(logged) == list(range(1, 9))
    assert all(len(logged[step]) == 1 for step in range(1, 7))
