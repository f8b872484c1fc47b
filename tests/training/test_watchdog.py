"""Slow steps and hangs named (`transformer/training/watchdog.py`): a step far above the median
dumps every thread's stack and names the slowest process, a step that never ends stops the run
naming who did not arrive, an evaluation or a save is no slow step, bad settings are one line."""

import logging
import pathlib
import subprocess
import sys
import time

import pytest
from conftest import subprocess_env

from transformer.config import resolve
from transformer.training import loop, watchdog

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Store:
    """The coordination service's key-value store, as the watchdog uses it."""

    def __init__(self, values=None):
        self.values = dict(values or {})

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.values, key
        self.values[key] = value

    def key_value_try_get(self, key):
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.values:
            time.sleep(timeout_ms / 1000)
            raise RuntimeError("DEADLINE_EXCEEDED")
        return self.values[key]


def steps(dog, first, count, seconds):
    for step in range(first, first + count):
        dog.beat(step)
        time.sleep(seconds)


def test_a_slow_step_dumps_every_stack_and_names_the_slowest_process(tmp_path, caplog):
    """Two processes' view from process 0: process 1 spent longer outside the device wait."""
    store = Store({watchdog.OUTSIDE_KEY.format(7, 1): "9.5"})
    with open(tmp_path / "stacks", "w") as stream, caplog.at_level(logging.INFO, "transformer"):
        dog = watchdog.Watchdog(slow_step_factor=4, step_timeout_seconds=0, client=store,
                                processes=2, stream=stream)
        steps(dog, 1, 6, 0.05)  # five timed (the sixth is in progress), median ~0.05 s
        dog.beat(7)
        time.sleep(1.0)  # > 4 x the median: the thread dumps the stacks while it runs
        dog.beat(8)
        dog.close()
    stacks = (tmp_path / "stacks").read_text()
    assert "test_a_slow_step_dumps_every_stack_and_names_the_slowest_process" in stacks
    assert 'Thread' in stacks and "_watch" in stacks  # every thread, the watchdog's too
    lines = [r.getMessage() for r in caplog.records]
    dumped = [line for line in lines if "the stacks of every thread" in line]
    assert len(dumped) == 1 and dumped[0].startswith("step 7 has run ")
    named = [line for line in lines if "the slowest process" in line]
    assert len(named) == 1 and "step 7 took" in named[0]
    assert "the slowest process is 1 (9.5 s outside" in named[0]
    assert "2 of 2 processes reported" in named[0]
    assert float(store.values[watchdog.OUTSIDE_KEY.format(7, 0)]) > 0.9  # its own, posted


def test_an_evaluation_or_a_save_is_no_slow_step(tmp_path, caplog):
    with open(tmp_path / "stacks", "w") as stream, caplog.at_level(logging.INFO, "transformer"):
        dog = watchdog.Watchdog(slow_step_factor=4, step_timeout_seconds=0, stream=stream)
        steps(dog, 1, 6, 0.05)
        dog.rest()  # the loop evaluates
        time.sleep(0.8)
        steps(dog, 7, 2, 0.05)
        dog.close()
    assert not [r for r in caplog.records if "stacks" in r.getMessage()]
    assert (tmp_path / "stacks").read_text() == ""


def test_a_step_that_never_ends_names_who_did_not_arrive(tmp_path):
    """Three processes: 1 is at step 5 with this one, 2 never got past step 3."""
    store = Store({watchdog.ARRIVED_KEY.format(1): "5", watchdog.ARRIVED_KEY.format(2): "3"})
    ended = []
    with open(tmp_path / "stacks", "w") as stream:
        dog = watchdog.Watchdog(slow_step_factor=0, step_timeout_seconds=0.5, client=store,
                                processes=3, on_hang=ended.append, stream=stream)
        dog.beat(5)
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
        dog.close()
    assert store.values[watchdog.ARRIVED_KEY.format(0)] == "5"
    assert len(ended) == 1 and "\n" not in ended[0]
    assert ended[0].startswith("step 5 did not end within step_timeout_seconds=0.5 (")
    assert ended[0].endswith("process 2 (at step 3) did not arrive at step 5; stopping the run")
    everyone = watchdog.Watchdog(slow_step_factor=0, step_timeout_seconds=1, client=Store(
        {watchdog.ARRIVED_KEY.format(p): "5" for p in range(2)}), processes=2)
    assert "every process arrived at step 5: a collective or a device" in \
        everyone._hang_line(5, 1.5)
    everyone.close()


@pytest.mark.slow
def test_a_hang_ends_the_process_with_one_line_and_the_stacks():
    """The default ending, in a process of its own: stacks, one `error:` line, status 1."""
    script = ("import time\nfrom transformer.training import watchdog\n"
              "dog = watchdog.Watchdog(slow_step_factor=0, step_timeout_seconds=0.5)\n"
              "dog.beat(1)\ntime.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, env=subprocess_env(), timeout=120)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: step 1 did not end within step_timeout_seconds=0.5 (1 s): the "
                      "device or a host thread of process 0 hangs (its stacks are above); "
                      "stopping the run"], done.stderr
    assert "most recent call first" in done.stderr and "<module>" in done.stderr


@pytest.mark.slow  # a training run: ~20 s on 2 shared cores
def test_a_training_run_names_a_step_slowed_by_its_data(load_config, monkeypatch, caplog,
                                                        tmp_path):
    """The loop's hook: batch 3 read slowly makes step 3 slow (the host reads it while the
    device runs step 3)."""
    from transformer.data import workers

    monkeypatch.setattr(watchdog, "WARMUP", 2)
    read = workers.TrainBatches.__next__

    def slow_third(self):
        if self.next_index == 3:  # well above 3x the first steps' median, ~0.05-1 s here
            time.sleep(4.0)
        return read(self)

    monkeypatch.setattr(workers.TrainBatches, "__next__", slow_third)
    cfg = load_config("tiny.py", **{  # test_replay.py's run: its compiled step is cached
        "data.batch_size": 16, "num_train_steps": 5, "checkpoint_every_steps": 5,
        "log_every_steps": 2, "eval_every_steps": 0, "model.d_model": 32, "model.d_ff": 64,
        "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
        "slow_step_factor": 3.0})
    with caplog.at_level(logging.INFO, "transformer"):
        loop.train_and_evaluate(cfg, str(tmp_path))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("step 3 has run ") for line in lines), lines
    assert any("step 3 took" in line and "the slowest process is 0" in line for line in lines)


def test_bad_settings_are_one_line(load_config):
    for key, value, pattern in (
            ("slow_step_factor", 1.0, r"slow_step_factor=1.0 must be > 1"),
            ("step_timeout_seconds", -1, r"step_timeout_seconds=-1(\.0)? must be >= 0")):
        with pytest.raises(ValueError, match=pattern) as error:
            resolve(load_config("tiny.py", **{key: value}))
        assert "\n" not in str(error.value)


HANG_SCRIPT = """
import sys, time
import jax, numpy as np
from jax.experimental import multihost_utils
index = int(sys.argv[2])
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=index)
from transformer.training.watchdog import Watchdog
dog = Watchdog.for_run({"step_timeout_seconds": 3.0})
for step in range(1, 6):
    if index == 1 and step == 3:
        time.sleep(300)  # a reader that never returns: process 1 never dispatches step 3
    dog.beat(step)
    multihost_utils.process_allgather(np.ones(1))  # the step's collective
"""


@pytest.mark.slow
def test_two_processes_name_the_one_that_did_not_arrive(tmp_path):
    """Process 1 hangs before its step 3; process 0 waits in step 3's collective. Both end
    within the timeout (and process 0's grace for its peers) naming process 1."""
    from test_multihost import free_port

    address = f"127.0.0.1:{free_port()}"
    env = subprocess_env()
    env.pop("JAX_COMPILATION_CACHE_DIR")  # never shared by several processes (test_multihost)
    procs = [subprocess.Popen([sys.executable, "-c", HANG_SCRIPT, address, str(i)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 1, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("error: step ")]
        assert len(errors) == 1, output[-3000:]
        assert "process 1 (at step 2) did not arrive at step 3; stopping the run" in errors[0]
        assert "most recent call first" in output  # the stacks
