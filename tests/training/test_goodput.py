"""Goodput (training/goodput.py): a run's wall time by part, carried over restarts, the work a
restart recomputes, and the line at exit."""

import json
import logging

import pytest

from transformer.checkpoint.checkpointer import Checkpointer
from transformer.training import goodput, loop


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_parts_are_timed_and_the_rest_is_steps():
    clock = Clock()
    spent = goodput.Goodput(clock=clock)
    clock.now += 3.0  # the source, the mesh: start-up
    with spent.timed("checkpoint"):  # restoring
        clock.now += 2.0
    with spent.timed("compile"):
        clock.now += 5.0
    spent.start_training()
    clock.now += 10.0  # steps
    spent.add("data_wait", 1.0)
    spent.add("evaluation", 1.5)
    assert spent.segment() == {"compile": 5.0, "checkpoint": 2.0, "data_wait": 1.0,
                               "evaluation": 1.5, "startup": 3.0, "restart": 0.0,
                               "steps": 7.5, "total": 20.0}
    assert spent.run() == spent.segment()
    assert spent.summary().startswith(
        "goodput 37.5% of the run's 20.0 s (steps 7.5 s, compile 5.0 s, checkpoint 2.0 s, "
        "data wait 1.0 s, evaluation 1.5 s, startup 3.0 s)")

    # a restart carries the run's totals and counts the recomputed steps as lost
    resumed = goodput.Goodput(clock=clock)
    resumed.carry(spent.run(), 4.0)
    clock.now += 6.0
    run = resumed.run()
    assert run["total"] == 20.0 + 4.0 + 6.0 and run["restart"] == 4.0
    assert run["steps"] == 7.5 + 6.0
    assert resumed.summary().startswith(f"goodput {100 * 13.5 / 30:.1f}% of the run's 30.0 s")
    assert "this process 100.0% of 6.0 s" in resumed.summary()


def test_recomputed_seconds_are_the_logged_steps_after_the_checkpoint(tmp_path):
    """Steps 5 and 6 were logged after checkpoint 4 (6 twice: the last line counts); the
    validation line and a torn last line are left out."""
    lines = [{"step": s, "split": "train", "loss": 1.0, "steps_per_sec": rate}
             for s, rate in ((3, 1.0), (4, 1.0), (5, 2.0), (6, 8.0), (6, 4.0))]
    lines.append({"step": 6, "split": "validation", "loss": 1.0})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 7, "split": "tr')
    assert goodput.recomputed_seconds(str(path), 4) == pytest.approx(0.5 + 0.25)
    assert goodput.recomputed_seconds(str(path), 6) == 0.0
    assert goodput.recomputed_seconds(str(tmp_path / "none.jsonl"), 0) == 0.0


def test_the_loop_saves_the_totals_and_says_goodput_at_exit(load_config, tmp_path, caplog):
    cfg = load_config("tiny.py", **{
        "data.batch_size": 16, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
        "num_train_steps": 2, "eval_every_steps": 0, "checkpoint_every_steps": 2})
    with caplog.at_level(logging.INFO, logger="transformer"):
        loop.train_and_evaluate(cfg, str(tmp_path))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("goodput ")]
    assert "compile" in line and "checkpoint" in line and "this process" in line
    checkpointer = Checkpointer(str(tmp_path), keep=1)
    data = checkpointer._manager.restore(2, args=_data_only())["data"]
    checkpointer.close()
    totals = data[goodput.STATE_KEY]
    assert set(totals) == {*goodput.PARTS, "steps", "total"}
    assert totals["compile"] > 0 and totals["steps"] > 0
    assert totals["total"] >= sum(v for k, v in totals.items() if k != "total") - 1e-6


def _data_only():
    import orbax.checkpoint as ocp

    return ocp.args.Composite(data=ocp.args.JsonRestore())
