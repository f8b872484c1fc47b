"""Goodput (training/goodput.py): a run's wall time by part, carried over restarts, the work a
restart recomputes, and the line at exit."""

import json
import logging

import pytest

from transformer.checkpoint import faults
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
    figures = resumed.figures()  # a train line's keys
    assert figures["goodput/run"] == 13.5 / 30 and figures["goodput/segment"] == 1.0
    assert figures["goodput/segment_index"] == 1 and resumed.state()[goodput.SEGMENT] == 1
    assert figures["goodput_seconds/restart"] == 4.0
    assert figures["goodput_seconds/compile"] == 5.0
    assert figures["goodput_segment_seconds/compile"] == 0.0
    assert figures["goodput_segment_seconds/total"] == 6.0


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


def train_lines(workdir) -> list[dict]:
    return [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "train"]


def saved_totals(workdir, step: int) -> dict:
    checkpointer = Checkpointer(str(workdir), keep=2)
    data = checkpointer._manager.restore(step, args=_data_only())["data"]
    checkpointer.close()
    return data[goodput.STATE_KEY]


def test_a_run_resumed_once_logs_carried_totals_and_the_lost_work(load_config, tmp_path,
                                                                   monkeypatch, caplog):
    """Segment 0 logs steps 1-3 and stops after update 4 (before its line); checkpoint 2 holds
    its totals. Segment 1 resumes from 2: its lines carry those totals, count step 3's logged
    time as lost to the restart and say segment 1; the exit line says goodput."""
    cfg = load_config("tiny.py", **{
        "data.batch_size": 16, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
        "model.d_model": 32, "model.d_ff": 64, "num_train_steps": 4, "eval_every_steps": 0,
        "log_every_steps": 1, "checkpoint_every_steps": 2})
    monkeypatch.setenv(faults.FAULT_ENV, "error@4")
    with pytest.raises(ValueError, match="injected fault after step 4"):
        loop.train_and_evaluate(cfg, str(tmp_path))
    monkeypatch.delenv(faults.FAULT_ENV)
    first = train_lines(tmp_path)
    assert [r["step"] for r in first] == [1, 2, 3]
    for r in first:  # segment 0: the run is the segment
        assert r["goodput/segment_index"] == 0 and r["goodput_seconds/restart"] == 0
        assert r["goodput/run"] == r["goodput/segment"] and 0 < r["goodput/run"] < 1
        assert r["goodput_seconds/compile"] > 0 and r["goodput_seconds/steps"] > 0
    carried = saved_totals(tmp_path, 2)
    assert set(carried) == {*goodput.PARTS, "steps", "total", goodput.SEGMENT}
    assert carried[goodput.SEGMENT] == 0 and carried["compile"] > 0

    with caplog.at_level(logging.INFO, logger="transformer"):
        loop.train_and_evaluate(cfg, str(tmp_path))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("goodput ")]
    assert "compile" in line and "restart" in line and "this process" in line
    resumed = train_lines(tmp_path)[3:]
    assert [r["step"] for r in resumed] == [3, 4]
    lost = 1 / first[2]["steps_per_sec"]  # step 3, computed again
    for r in resumed:
        assert r["goodput/segment_index"] == 1
        assert r["goodput_seconds/restart"] == pytest.approx(lost, rel=1e-12)
        assert r["goodput_segment_seconds/restart"] == 0
        for part in (*goodput.PARTS, "steps", "total"):  # the run: carried plus the segment
            extra = lost if part in ("restart", "total") else 0.0
            assert r[f"goodput_seconds/{part}"] == pytest.approx(
                carried[part] + extra + r[f"goodput_segment_seconds/{part}"], rel=1e-9), part
        assert r["goodput/run"] == pytest.approx(
            r["goodput_seconds/steps"] / r["goodput_seconds/total"], rel=1e-9)
    assert saved_totals(tmp_path, 4)[goodput.SEGMENT] == 1


def _data_only():
    import orbax.checkpoint as ocp

    return ocp.args.Composite(data=ocp.args.JsonRestore())
