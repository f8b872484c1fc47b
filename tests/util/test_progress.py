"""Progress figures (tokens/s, ETA, data-wait fraction, MFU) from a controlled clock and known
token counts, and TensorBoard events that TensorFlow's reader reads as metrics.jsonl."""

import json
import types

import jax
import numpy as np
import pytest

from transformer.training import evaluation, loop, metrics


class Clock:
    """Seconds that move only when told."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lines:
    """A MetricWriter stand-in that keeps what is written."""

    def __init__(self):
        self.lines = []

    def write(self, step, split, values):
        self.lines.append((step, split, values))


def test_progress_window_figures():
    clock = Clock()
    progress = metrics.Progress(10, 110, clock=clock)
    for wait in (0.5, 1.5):  # two steps, 2 s waiting for data
        progress.add_step(wait)
    progress.add_tokens(3000.0)
    clock.now += 3.0  # an evaluation of 3 s, left out of the window
    progress.exclude(3.0)
    clock.now += 8.0
    figures = progress.report(12)
    assert figures["tokens_per_sec"] == pytest.approx(3000 / 8)
    assert figures["data_wait_fraction"] == pytest.approx(2 / 8)
    assert figures["steps_per_sec"] == pytest.approx(2 / 8)
    assert figures["eta_seconds"] == pytest.approx((110 - 12) * 8 / 2)
    # The next window starts at the report: nothing carried over.
    progress.add_step(0.0)
    progress.add_tokens(100.0)
    clock.now += 4.0
    figures = progress.report(13)
    assert figures["tokens_per_sec"] == pytest.approx(25.0)
    assert figures["data_wait_fraction"] == 0.0
    assert figures["eta_seconds"] == pytest.approx((110 - 13) * 4.0)


def step_metrics(loss, tokens, *, nonfinite=False):
    return {"loss": np.float32(loss), "learning_rate": np.float32(1e-3),
            "grad_norm": np.float32(0.5), "target_tokens": np.float32(tokens - 10),
            "sequence_tokens": np.float32(tokens), "nonfinite": np.bool_(nonfinite)}


def test_flush_writes_throughput_data_wait_and_mfu_per_line():
    """Two steps of 600 and 400 sequence tokens in 5 s (1 s waiting for data): 200 tokens/s;
    at 1e9 FLOPs per token on devices of 1e12 peak each, MFU = 2e11 / (1e12 x devices)."""
    clock = Clock()
    writer = Lines()
    progress = metrics.Progress(0, 4, clock=clock)
    progress.add_step(0.75)
    progress.add_step(0.25)
    clock.now += 5.0
    pending = [(1, step_metrics(2.5, 600)), (2, step_metrics(2.0, 400))]
    cfg = types.SimpleNamespace(skip_nonfinite_updates=False)
    loop._flush(pending, progress, writer, 2, 4, 1e9, 1e12, cfg, None)
    assert [(s, split) for s, split, _ in writer.lines] == [(1, "train"), (2, "train")]
    for (_, _, line), loss in zip(writer.lines, (2.5, 2.0), strict=True):
        assert line["loss"] == loss
        assert line["tokens_per_sec"] == pytest.approx(200.0)
        assert line["steps_per_sec"] == pytest.approx(2 / 5)
        assert line["data_wait_fraction"] == pytest.approx(0.2)
        assert line["mfu"] == pytest.approx(1e9 * 200.0 / (1e12 * jax.device_count()))
        assert line["nonfinite_skipped"] == 0
    assert writer.lines[0][2]["target_tokens_per_update"] == 590


def test_flush_without_a_peak_writes_no_mfu():
    clock = Clock()
    writer = Lines()
    progress = metrics.Progress(0, 1, clock=clock)
    progress.add_step(0.0)
    clock.now += 1.0
    loop._flush([(1, step_metrics(1.0, 50))], progress, writer, 1, 1, 1e9, None,
                types.SimpleNamespace(skip_nonfinite_updates=False), None)
    assert "mfu" not in writer.lines[0][2]
    assert writer.lines[0][2]["tokens_per_sec"] == pytest.approx(50.0)


@pytest.mark.parametrize(("architecture", "unit"), [
    ("encoder_decoder", "tok"), ("decoder", "tok"), ("vision", "img"), ("classifier", "ex")])
def test_progress_line_names_what_the_run_counts(architecture, unit):
    """The metric stays `tokens_per_sec`; the console says images/s for a ViT, examples/s for a
    text classifier."""
    values = {"loss": 1.0, "learning_rate": 1e-3, "tokens_per_sec": 1234.4,
              "data_wait_fraction": 0.0, "eta_seconds": 0.0}
    got = loop._progress_unit(types.SimpleNamespace(architecture=architecture))
    assert got == unit
    assert f" | 1,234 {unit}/s | " in metrics.format_progress(3, 9, values, got)


def test_tensorboard_events_hold_the_metrics_jsonl_values(tmp_path):
    """Read back by TensorFlow's own event reader (the `data` extra; `tensorboard` reads the
    same records)."""
    import tensorflow as tf

    writer = metrics.MetricWriter(str(tmp_path))
    writer.write(1, "train", {"loss": np.float32(2.5), "learning_rate": 1e-3, "grad_norm": 0.7,
                              "tokens_per_sec": 1234.5})
    writer.write(2, "train", {"loss": 2.25, "learning_rate": 2e-3, "grad_norm": 0.6,
                              "tokens_per_sec": 1500.0})
    writer.write(2, "validation", {"loss": 2.75, "perplexity": 15.64, "bleu_signature": "x"})
    writer.close()

    expected = {}
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key not in ("step", "split") and isinstance(value, int | float):
                expected[(f"{record['split']}/{key}", record["step"])] = value
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    found = {}
    for event in tf.compat.v1.train.summary_iterator(str(events[0])):
        for value in event.summary.value:
            found[(value.tag, event.step)] = value.simple_value
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        assert found[key] == pytest.approx(value, rel=1e-7), key  # stored as float32


def test_sync_puts_every_scalar_written_before_it_in_the_event_files(tmp_path, monkeypatch):
    """tensorboardX writes events from a queue on its own thread, and its flush does not wait
    for that queue: `sync` (before a checkpoint save) must. The thread is slowed here."""
    import time

    from tensorboardX import event_file_writer
    from tensorboardX.proto import event_pb2

    write_event = event_file_writer.EventsWriter.write_event

    def slow(self, event):
        time.sleep(0.02)
        return write_event(self, event)

    monkeypatch.setattr(event_file_writer.EventsWriter, "write_event", slow)
    writer = metrics.MetricWriter(str(tmp_path))
    expected = set()
    for round_ in range(2):  # a second sync: the events after the first land too
        for step in range(1 + 5 * round_, 6 + 5 * round_):
            writer.write(step, "train", {"loss": 1.0 / step, "grad_norm": 0.5})
            expected |= {("train/loss", step), ("train/grad_norm", step)}
        writer.sync()
        found = set()
        for name in (tmp_path / "tensorboard").glob("events.out.tfevents.*"):
            data = name.read_bytes()
            offset = 0
            while offset < len(data):  # TFRecord: length, its crc, the record, its crc
                length = int.from_bytes(data[offset:offset + 8], "little")
                event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
                found |= {(value.tag, event.step) for value in event.summary.value}
                offset += 16 + length
        assert found == expected
    writer.close()


def test_eta_adds_the_evaluations_due_and_the_scoring_after_training():
    """110 updates at 2 a second; a validation pass every 20 steps and a BLEU decode every 50,
    both at the last step too (110); then the test split's 300 sentences scored. Each cost is
    the last one of its kind less its compiling (per sentence for the scoring, which compiles
    afresh: plus the first one's compiling); unmeasured ones are named."""
    clock = Clock()
    progress = metrics.Progress(0, 110, clock=clock,
                                every={"validation pass": 20, "BLEU decode": 50, "none": 0},
                                final={"test pass": ("validation pass", 300),
                                       "test decode": ("BLEU decode", 300)})

    def report(step, seconds):
        for _ in range(10):
            progress.add_step(0.0)
        clock.now += seconds
        return progress.report(step)

    figures = report(10, 5.0)  # nothing measured yet: the updates alone, the rest named
    assert figures["eta_seconds"] == pytest.approx(100 / 2)
    assert figures["eta_untimed"] == ["validation pass", "BLEU decode", "test pass",
                                      "test decode"]
    report(20, 5.0)
    clock.now += 4.0  # the validation pass at step 20, over 100 sentences, 1 s compiling
    progress.exclude(4.0)
    progress.evaluated("validation pass", 20, 4.0, 100, compiled=1.0)
    figures = report(30, 5.0)  # the rate leaves the 4 s out
    assert figures["steps_per_sec"] == pytest.approx(2.0)
    # passes at 40, 60, 80, 100, 110 of 3 s; the test pass 1 s + 3 s / 100 sentences x 300
    assert figures["eta_seconds"] == pytest.approx(80 / 2 + 5 * 3.0 + 1.0 + 3.0 * 300 / 100)
    assert figures["eta_untimed"] == ["BLEU decode", "test decode"]
    progress.evaluated("validation pass", 40, 2.0, 100)
    progress.evaluated("BLEU decode", 50, 14.0, 20, compiled=4.0)  # 20 sentences in 10 s
    figures = report(60, 5.0)  # before step 60's pass: passes 60, 80, 100, 110; decodes 100, 110
    assert figures["eta_seconds"] == pytest.approx(
        50 / 2 + 4 * 2.0 + 2 * 10.0 + (1.0 + 2.0 * 300 / 100) + (4.0 + 10.0 * 300 / 20))
    assert figures["eta_untimed"] == []
    progress.evaluated("validation pass", 60, 2.0, 100)
    assert progress.remaining(60, 2.0)[0] == pytest.approx(
        50 / 2 + 3 * 2.0 + 2 * 10.0 + 7.0 + 154.0)  # step 60's pass is done
    progress.evaluated("validation pass", 100, 2.0, 100)
    progress.evaluated("BLEU decode", 100, 8.0, 20)
    # The last step, before its evaluations: one of each, then the scoring.
    assert progress.remaining(110, 2.0) == (pytest.approx(2.0 + 8.0 + 7.0 + 124.0), [])
    progress.evaluated("validation pass", 110, 2.0, 100)
    progress.evaluated("BLEU decode", 110, 8.0, 20)
    assert progress.remaining(110, 2.0) == (pytest.approx(7.0 + 124.0), [])


def test_timed_leaves_compiling_out_and_keeps_it_for_the_scoring():
    """`Progress.timed` around a first call of a jitted function: its compile seconds
    (`compile_seconds`, from JAX's events) are split off the evaluation's cost."""
    progress = metrics.Progress(0, 10, clock=Clock())
    metrics.compile_seconds()  # listening before the compile
    with progress.timed("validation pass", 5) as timing:
        jax.jit(lambda x: x * 3 + 1)(np.arange(7.0)).block_until_ready()
        timing.items = 7
    compiled = progress.compiled["validation pass"]
    assert compiled > 0
    step, seconds, items = progress.measured["validation pass"]
    assert (step, items) == (5, 7) and seconds >= 0.0
    with progress.timed("validation pass", 10):  # nothing compiled: the first's kept
        pass
    assert progress.compiled["validation pass"] == compiled


def test_eta_without_sentence_counts_takes_the_last_evaluations_seconds():
    """An image classifier's test split, scored after its last update: as long as its last
    validation pass (no sentences to scale by). Evaluations off (0) are never due."""
    progress = metrics.Progress(0, 10, clock=Clock(), every={"validation pass": 4},
                                final={"test pass": ("validation pass", None)})
    progress.evaluated("validation pass", 4, 7.0, None, compiled=1.0)
    assert progress.remaining(5, 1.0) == (pytest.approx(5 + 2 * 6.0 + 7.0), [])  # 8, 10, test
    progress = metrics.Progress(0, 10, clock=Clock(), every={"validation pass": 0})
    assert progress.remaining(5, 1.0) == (pytest.approx(5.0), [])


@pytest.mark.parametrize(("sentences", "rows"), [(0, 0), (1, 1), (20, 32), (32, 32), (33, 33),
                                                 (300, 304), (2117, 2120)])
def test_decoded_rows_are_batches_of_32_padded_to_powers_of_two(sentences, rows):
    assert evaluation.decoded_rows(sentences) == rows


def test_progress_line_shows_an_eta_with_untimed_parts_as_a_lower_bound():
    values = {"loss": 1.0, "learning_rate": 1e-3, "tokens_per_sec": 10.0,
              "data_wait_fraction": 0.0, "eta_seconds": 3725.0}
    assert " | ETA 1:02:05 | " in metrics.format_progress(3, 9, values | {"eta_untimed": []})
    line = metrics.format_progress(3, 9, values | {"eta_untimed": ["BLEU decode",
                                                                   "test decode"]})
    assert " | ETA >1:02:05 (not yet timed: BLEU decode, test decode) | " in line
