"""Several processes on one machine stand in for several hosts: `train.py` with
`--coordinator_address`, gloo collectives over 127.0.0.1, 4 fake CPU devices per process."""

import itertools
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import CACHE_DIR, FAST_COMPILE, SHRUNK_DEFAULT

from transformer.checkpoint.faults import FAULT_ENV

_RUNS = itertools.count()
ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMON = ["--config=configs/tiny.py", "--config.log_every_steps=1",
          "--config.data.batch_size=16", "--config.eval_every_steps=10",
          "--config.data.eval_examples=100",  # 7 eval batches of 16, the last one uneven
          "--config.checkpoint_every_steps=10",
          # One layer each side at width 32 (4 heads, so tensor 2 still splits them): every
          # start compiles afresh (~1 min on 2 cores at tiny.py's 2 layers of 64), and the
          # processes, meshes and collectives under test are those of any size.
          "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
          "--config.model.d_model=32", "--config.model.d_ff=64"]
# The fatal line of a process that the coordination service stops after a peer died.
DEAD_PEER_MESSAGE = ("Terminating process because the JAX distributed service detected fatal "
                     "errors. This most likely indicates that another task died")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workdir, *, processes: int, devices: int, overrides=(),
           common=tuple(COMMON), faults=None) -> list[subprocess.Popen]:
    """`processes` train.py processes with `devices` fake CPU devices each: the `common` flags
    (the tiny config) then `overrides`; `faults` maps a process index to the fault it injects
    (TRANSFORMER_FAULT_INJECT, transformer/checkpoint/faults.py)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}")
    # No persistent compilation cache with several processes: an executable compiled for 1
    # process x 8 devices has the same cache key as one for 2 processes x 4 devices but no
    # cross-process collectives (loading it hangs the 2-process run), and 2-process runs sharing
    # one cache hung in CI. One process uses the tests' cache, which only 1-process programs fill.
    if processes > 1:
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    else:
        env.update(JAX_COMPILATION_CACHE_DIR=str(CACHE_DIR),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    env.pop(FAULT_ENV, None)
    command = [sys.executable, "train.py", f"--workdir={workdir}", *common, *overrides]
    if processes > 1:
        port = free_port()
        command.append(f"--coordinator_address=127.0.0.1:{port}")
        command.append(f"--num_processes={processes}")
    procs = []
    for i in range(processes):
        # Output goes to files: a pipe nobody reads yet would block a process mid-collective.
        log = open(f"{workdir}-run{next(_RUNS)}-process{i}.log", "w")
        fault = {FAULT_ENV: (faults or {})[i]} if i in (faults or {}) else {}
        procs.append(subprocess.Popen(command + ([f"--process_id={i}"] if processes > 1 else []),
                                      cwd=ROOT, env=env | fault, stdout=log,
                                      stderr=subprocess.STDOUT))
        procs[-1].log_path = log.name
    return procs


def output_of(process) -> str:
    return pathlib.Path(process.log_path).read_text()


def finish(procs, timeout=600):
    """Waits for every process; on a failure shows the output of all of them (a hang in one
    shows up as an error in another)."""
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if any(p.returncode != 0 for p in procs):
        pytest.fail("\n".join(f"--- process {i} exited {p.returncode}:\n{output_of(p)[-4000:]}"
                               for i, p in enumerate(procs)))


def figures(workdir) -> dict[tuple[int, str], float]:
    """The last loss per (step, split)."""
    found = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            found[(record["step"], record["split"])] = record["loss"]
    return found


@pytest.mark.slow
def test_two_processes_match_one_then_restore_on_one(tmp_path):
    mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=-1", "--config.mesh.tensor=2",
            "--config.eval_every_steps=4", "--config.checkpoint_every_steps=4"]
    reference = tmp_path / "one_process"
    # 8 steps, evaluated and saved every 4: 2 processes run the first 4 (a step, an
    # evaluation and a save of theirs are what is compared), 1 process resumes at 5.
    finish(launch(reference, processes=1, devices=8,
                  overrides=[*mesh, "--config.num_train_steps=8"]))
    expected = figures(reference)

    workdir = tmp_path / "two_processes"
    finish(launch(workdir, processes=2, devices=4,
                  overrides=[*mesh, "--config.num_train_steps=4"]))
    first = figures(workdir)
    assert sorted(first) == sorted(k for k in expected if k[0] <= 4)
    assert (4, "validation") in first
    keys = sorted(first)
    np.testing.assert_allclose([first[k] for k in keys], [expected[k] for k in keys], rtol=1e-4)
    assert (workdir / "checkpoints" / "4").is_dir()

    # The checkpoint written by 2 processes x 4 devices continues on 1 process x 4 devices.
    procs = launch(workdir, processes=1, devices=4,
                   overrides=["--config.mesh.data=2", "--config.mesh.fsdp=-1",
                              "--config.mesh.tensor=1", "--config.eval_every_steps=4",
                              "--config.checkpoint_every_steps=4", "--config.num_train_steps=8"])
    finish(procs)
    assert f"resuming from {workdir / 'checkpoints'}/4" in output_of(procs[0])
    resumed = figures(workdir)
    assert sorted(resumed) == sorted(expected)
    keys = sorted(expected)
    # Another mesh (tensor 2 -> 1) sums in another order; Adam (eps 1e-9) turns that rounding
    # into +-lr steps on the key biases (test_train.assert_params_close), so the difference
    # grows with the steps: 1.2e-4 at step 20 in one CI run (2 layers of 64), < 1e-4 before it.
    np.testing.assert_allclose([resumed[k] for k in keys], [expected[k] for k in keys],
                               rtol=3e-4)


@pytest.mark.slow
def test_a_dead_peer_stops_the_survivor_within_the_heartbeat_timeout(tmp_path):
    heartbeat = 5
    procs = launch(tmp_path, processes=2, devices=4,
                   overrides=["--config.num_train_steps=100000", "--config.eval_every_steps=0",
                              f"--config.distributed.heartbeat_timeout_seconds={heartbeat}"])
    deadline = time.monotonic() + 600
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert all(p.poll() is None for p in procs), output_of(procs[0])
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    # Event-based: the survivor ends on the coordination service's verdict that process 1
    # stopped sending heartbeats, not on a collective's timeout or an unrelated error. Measured
    # (2 shared cores): it exits ~3.4 s after the last metrics line before the kill, with a 5 s
    # heartbeat; the wait's limit only turns a hang into a failure.
    procs[0].wait(timeout=heartbeat + 60)
    output = output_of(procs[0])
    assert procs[0].returncode != 0
    assert DEAD_PEER_MESSAGE in output and "stopped sending heartbeats" in output, output[-3000:]


@pytest.mark.slow
def test_a_peer_that_exits_with_an_error_stops_the_others_naming_it(tmp_path):
    """Process 1 stops on an error (injected after step 3) while process 0 goes on into the
    next step's collective. Before, both waited (process 1 in JAX's shutdown barrier, still
    sending heartbeats; process 0 in the collective) for minutes. Now process 1 posts its error
    to the coordination service and process 0 stops on it with one line naming process 1."""
    heartbeat = 5
    procs = launch(tmp_path, processes=2, devices=4, faults={1: "error@3"},
                   overrides=["--config.num_train_steps=100000", "--config.eval_every_steps=0",
                              f"--config.distributed.heartbeat_timeout_seconds={heartbeat}"])
    procs[1].wait(timeout=900)  # compiling, then 3 steps
    # Event-based: process 0 ends on process 1's notice (its line below), not on a timeout or
    # on the heartbeat verdict; the wait's limit only turns a hang into a failure.
    procs[0].wait(timeout=heartbeat + 60)
    failed = output_of(procs[1])
    survivor = output_of(procs[0])
    notice = "error: injected fault after step 3 (TRANSFORMER_FAULT_INJECT=error@3)"
    assert procs[1].returncode == 1 and notice in failed, failed[-3000:]
    assert procs[0].returncode == 1, survivor[-3000:]
    assert f"error: process 1 failed (ValueError: {notice[7:]}); stopping process 0 too" in \
        survivor, survivor[-3000:]
    assert "stopped sending heartbeats" not in survivor
    assert "Traceback" not in failed + survivor


class _FakeKeyValueStore:
    """The coordination service's key-value store in memory, its calls recorded; a key not
    set times out at once."""

    def __init__(self, keys=()):
        self.values, self.calls = dict.fromkeys(keys, "1"), []

    def key_value_set(self, key, value):
        self.calls.append(("set", key))
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        self.calls.append(("get", key))
        if key not in self.values:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        return self.values[key]


class _Exited(Exception):
    pass


@pytest.mark.parametrize("index, marked, calls, lingers", [
    # host of the service: after both peers' marks, and a linger for their exits
    (0, (1, 2), [("get", 1), ("get", 2)], True),
    (0, (2,), [("get", 1)], False),  # a peer that never marks its end: no longer than the grace
    (1, (), [("set", 1)], False),  # a peer: marks its end, waits for nobody
])
def test_the_process_hosting_the_coordination_service_exits_after_its_peers(
        monkeypatch, index, marked, calls, lingers):
    """The CI failures this prevents: process 0 ended on process 1's notice at once, so the
    service it hosts vanished under process 1 (still posting), which JAX then aborted (SIGABRT,
    return code -6) before it printed its error. Later, on a loaded CI machine, the same abort
    came between process 1's mark and its exit: process 0 now lingers after the marks."""
    from transformer.parallel import distributed

    monkeypatch.setattr(distributed.jax, "process_index", lambda: index)
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 3)

    def exit_(status):
        raise _Exited(status)

    monkeypatch.setattr(distributed.os, "_exit", exit_)
    monkeypatch.setattr(distributed.FailureNotices, "GRACE_S", 0.2)
    sleeps = []
    monkeypatch.setattr(distributed.time, "sleep", sleeps.append)
    notices = distributed.FailureNotices()
    stopped = distributed.FailureNotices.STOPPED_KEY
    notices._client = store = _FakeKeyValueStore(f"{stopped}/{peer}" for peer in marked)
    started = time.monotonic()
    with pytest.raises(_Exited) as exited:
        notices._exit()
    assert exited.value.args == (1,)
    assert store.calls == [(kind, f"{stopped}/{peer}") for kind, peer in calls]
    assert sleeps == ([distributed.FailureNotices.LINGER_S] if lingers else [])
    assert time.monotonic() - started < 1.0


@pytest.mark.slow
def test_two_processes_decode_validation_bleu(offline_fixture_data_dir, tmp_path):
    """Beam search over params sharded across two processes, long enough (64 positions) for the
    translator's stages: the first sentence reaches its limit (43 steps) in the third stage, and
    both processes go on with the other sentence alone (checked once by printing). Its loss and
    BLEU are those that `--score_split=validation` scores after training, as
    `transformer.evaluate` does: in process 0 alone, on one device, printing evaluate's line,
    while process 1 waits for it."""
    workdir = tmp_path / "run"
    overrides = ["--config=configs/default.py",
                 f"--config.data.data_dir={offline_fixture_data_dir}",
                 "--config.num_train_steps=2", "--config.log_every_steps=1",
                 *(f"--config.{key}={value}" for key, value in SHRUNK_DEFAULT.items()),
                 "--config.model.max_len=64", "--config.decode.max_extra_length=40",
                 "--score_split=validation"]
    procs = launch(workdir, processes=2, devices=4, overrides=overrides, common=())
    finish(procs)
    with open(workdir / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    validation, reference = [line for line in lines if line["split"] == "validation"]
    assert validation["step"] == 2 and validation["bleu_num_sentences"] == 2
    assert (reference["step"], reference["checkpoint"]) == (2, "latest")
    assert reference["bleu_num_sentences"] == 2  # the whole split: 2 pairs
    assert validation["bleu"] == pytest.approx(reference["bleu"], abs=1e-9)
    assert validation["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    printed = f"validation: perplexity {reference['perplexity']:.2f} | sacreBLEU "
    assert printed in output_of(procs[0]) and printed not in output_of(procs[1])
    assert (workdir / "eval" / "validation.latest.translation.txt").exists()


@pytest.mark.slow
def test_a_masked_language_model_trains_alike_on_one_and_two_processes(offline_fixture_data_dir,
                                                                        tmp_path):
    """The LM source feeds each process its rows (masks drawn per global row): 2 processes x 4
    devices give the losses of 1 process x 8, to float32 rounding."""
    shrink = {"data.data_dir": offline_fixture_data_dir, "data.vocab_size": 200,
              "data.max_length": 32, "model.max_len": 32, "data.batch_size": 8,
              "model.d_model": 32, "model.d_ff": 64, "model.num_heads": 2,
              "model.num_kv_heads": 1, "model.num_encoder_layers": 1,
              "optimizer.warmup_steps": 1, "num_train_steps": 3, "eval_every_steps": 3,
              "checkpoint_every_steps": 0, "checkpoint_every_minutes": 0,
              "log_every_steps": 1}
    overrides = ["--config=configs/mlm_default.py",
                 *(f"--config.{key}={value}" for key, value in shrink.items())]
    finish(launch(tmp_path / "one", processes=1, devices=8, overrides=overrides, common=()))
    finish(launch(tmp_path / "two", processes=2, devices=4, overrides=overrides, common=()))
    one = figures(tmp_path / "one")
    two = figures(tmp_path / "two")
    assert sorted(one) == sorted(two) == [(1, "train"), (2, "train"), (3, "train"),
                                          (3, "validation")]
    np.testing.assert_allclose([two[k] for k in sorted(two)], [one[k] for k in sorted(one)],
                               rtol=1e-5)
