"""`data.workers` (`transformer/data/workers.py`): batches from Grain worker processes are those
the loop makes itself, bit for bit, from any start index; a run resumed with workers continues
at its checkpoint's index with the same losses; a worker's error is one line naming it, and a
SIGTERM (a preemption) is the main process' to handle. Closed, they leave no shared memory
behind."""

import json
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, subprocess_env
from test_data_files import small_lm_files_config


@pytest.fixture
def config(tmp_path):
    """test_data_files' run with one layer, no evaluation and checkpoints by step only."""
    cfg = small_lm_files_config(tmp_path)
    cfg.model.num_decoder_layers = 1
    cfg.optimizer.warmup_steps = 1
    cfg.update(dict(eval_every_steps=0, checkpoint_every_minutes=0))
    return cfg


def test_worker_batches_equal_the_loops_and_an_error_is_one_line(config, tmp_path):
    from transformer.data import make_source
    from transformer.data.workers import TrainBatches, WorkerError

    workdir = str(tmp_path / "run")
    source = make_source(config, workdir)
    batches = TrainBatches(source, config, workdir, (2, 6), start=3, count=4, workers=2)
    try:
        got = [next(batches) for _ in range(4)]
    finally:
        batches.close()
    for index, batch in enumerate(got, start=3):
        want = source.train_batch(index, (2, 6))
        assert sorted(batch) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(batch[key], want[key])
    config.data.vocab_size = config.model.vocab_size = 65  # not the workdir's vocabulary
    batches = TrainBatches(source, config, workdir, (0, 8), start=5, count=2, workers=2)
    with pytest.raises(WorkerError) as error:
        next(batches)
    batches.close()
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("data.workers=2: worker 0 failed on batch 5: VocabularyMismatch:")
    assert "data.vocab_size=65" in message
    with pytest.raises(ValueError, match=r"data.workers=-1 must be >= 0"):
        TrainBatches(source, config, workdir, (0, 8), start=0, count=1, workers=-1)


def test_workers_leave_sigterm_to_the_main_process(config, tmp_path):
    import multiprocessing
    import os
    import signal

    from transformer.data import make_source
    from transformer.data.workers import TrainBatches

    workdir = str(tmp_path / "run")
    source = make_source(config, workdir)
    batches = TrainBatches(source, config, workdir, (0, 8), start=0, count=3, workers=1)
    try:
        waited = time.monotonic() + 60  # the worker starts before the first batch is asked for
        while not multiprocessing.active_children() and time.monotonic() < waited:
            time.sleep(0.1)
        assert multiprocessing.active_children()
        next(batches)
        for child in multiprocessing.active_children():  # Grain's worker
            os.kill(child.pid, signal.SIGTERM)  # a preemption signals every process
        np.testing.assert_array_equal(next(batches)["targets"],
                                      source.train_batch(1, (0, 8))["targets"])
    finally:
        batches.close()


# Reads every batch, so that each worker's prefetch thread runs out, then exits at once.
READ_ALL_AND_EXIT = """
import pickle, sys
from transformer.data import make_source
from transformer.data.workers import TrainBatches
with open(sys.argv[1], "rb") as f:
    cfg = pickle.load(f)
workdir = sys.argv[2]
batches = TrainBatches(make_source(cfg, workdir), cfg, workdir, (0, 8), start=0, count=4,
                       workers=2)
for _ in range(4):
    next(batches)
batches.close()
"""


def test_closed_workers_leave_no_shared_memory_to_the_resource_tracker(config, tmp_path):
    """Python's resource tracker unlinks, at the process' exit, the shared memory still linked
    and warns of it: the warning is looked for in the stderr of a process of its own."""
    from transformer.data import make_source

    workdir = str(tmp_path / "run")
    make_source(config, workdir)  # the vocabulary and row counts the workers read
    (tmp_path / "config.pkl").write_bytes(pickle.dumps(config))
    done = subprocess.run(
        [sys.executable, "-c", READ_ALL_AND_EXIT, str(tmp_path / "config.pkl"), workdir],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr


def test_the_input_benchmark_gives_no_rate_over_no_cpu_time(monkeypatch):
    """benchmarks/input_workers.py reads CPU time in clock ticks: over a few updates it can
    count none, and the rate per CPU second is then null, not a division by zero."""
    from benchmarks import input_workers

    class Source:
        def train_batch(self, index, rows):
            return {"targets_segmentation": np.ones((2, 4), np.int32)}

    monkeypatch.setattr(input_workers, "_cpu_seconds", lambda: 12.0)
    run = input_workers._measure(Source(), None, None, 2, workers=0, start=0, updates=2)
    assert run["tokens"] == 16
    assert run["tokens_per_cpu_s"] is None
    runs = [run, dict(run, tokens_per_cpu_s=5)]
    assert input_workers._by_workers(runs, "tokens_per_cpu_s") == {0: [5]}


def _losses(workdir) -> dict[int, float]:
    with open(workdir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["split"] == "train"}


def test_training_with_workers_matches_and_resumes_at_the_checkpoint_index(config, tmp_path,
                                                                          monkeypatch):
    from transformer.checkpoint import faults
    from transformer.training.loop import train_and_evaluate

    train_and_evaluate(config, str(tmp_path / "inline"))
    config.data.workers = 2
    monkeypatch.setenv(faults.FAULT_ENV, "error@4")  # fails after step 4, saved at 3
    with pytest.raises(ValueError, match="injected fault after step 4"):
        train_and_evaluate(config, str(tmp_path / "workers"))
    monkeypatch.delenv(faults.FAULT_ENV)
    train_and_evaluate(config, str(tmp_path / "workers"))  # resumes: workers from batch 3
    inline = _losses(tmp_path / "inline")
    assert sorted(inline) == list(range(1, 7))
    assert _losses(tmp_path / "workers") == inline
