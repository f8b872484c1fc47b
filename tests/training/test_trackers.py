"""Experiment trackers (`metrics.tracker`, `transformer/util/trackers.py`): Weights & Biases
(offline) and trackio (local) get every numeric figure, the per-layer ones included, and the
config; a training run sends them; TensorBoard stays the default; bad input is one line.
(`MetricWriter.sync` draining tensorboardX's queue: tests/util/test_progress.py.)"""

import glob
import importlib.util
import json

import pytest

from transformer.checkpoint import layout
from transformer.config import resolve
from transformer.training import loop, metrics
from transformer.util import trackers

LINES = [(1, "train", {"loss": 2.5, "grad_norm": 0.75, "grad_norm/decoder/layers_0/attention":
                       0.25, "nonfinite_skipped": 0}),
         (2, "train", {"loss": 2.25, "grad_norm": 0.5, "grad_norm/decoder/layers_0/attention":
                       0.125, "nonfinite_skipped": 0}),
         (2, "validation", {"loss": 2.75, "perplexity": 15.5, "bleu_signature": "not a number"})]
EXPECTED = {(f"{split}/{key}", step): value for step, split, values in LINES
            for key, value in values.items() if not isinstance(value, str)}
STARTED = "2026-12-05T12:00:00+0000"


def write_run(workdir, tracker) -> None:
    """config.json (the loop writes it first), then LINES through a MetricWriter."""
    workdir.mkdir(exist_ok=True)
    layout.write_config(str(workdir), {"model": {"d_model": 32}, "seed": 3},
                        {"started": STARTED})
    writer = metrics.MetricWriter(str(workdir), tracker, log_config=True)
    for step, split, values in LINES:
        writer.write(step, split, values)
    writer.sync()
    writer.close()


def wandb_records(path):
    """The records of an offline run's `.wandb` file: a 7-byte header, then LevelDB's log
    format (32 KiB blocks of records: crc32c, length, type; FULL=1, FIRST, MIDDLE, LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header: padding
            position += 32768 - position % 32768
            continue
        length = int.from_bytes(data[position + 4:position + 6], "little")
        kind = data[position + 6]
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(workdir):
    """({(key, step): value} of the history, the config) of the offline run in `workdir`,
    once W&B's service has written it whole (it does at the latest when the process ends)."""
    import wandb

    wandb.teardown()
    history, config = {}, {}
    files = glob.glob(f"{workdir}/wandb/offline-run-*/run-*.wandb")
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                history |= {(k, items["_step"]): v for k, v in items.items()
                            if not k.startswith("_")}
            elif kind == "run":
                config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
    return history, config, files


@pytest.fixture
def offline_wandb(monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_offline_gets_every_figure_and_the_config(tmp_path, offline_wandb):
    write_run(tmp_path, "wandb")
    history, config, files = wandb_run(tmp_path)
    assert history == EXPECTED
    assert config["model"] == {"d_model": 32} and config["provenance"]["started"] == STARTED
    assert not (tmp_path / "tensorboard").exists()  # the chosen tracker only
    identity = trackers.run_id(str(tmp_path), STARTED)
    assert [f.rsplit("/", 1)[1] for f in files] == [f"run-{identity}.wandb"]


def test_trackio_locally_gets_every_figure_and_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio loads
    monkeypatch.setenv("TRACKIO_PROJECT", "trackers-test")
    trackio = pytest.importorskip("trackio")
    from trackio import sqlite_storage, utils

    for module in (trackio, utils, sqlite_storage):  # where it was loaded before this test
        if hasattr(module, "TRACKIO_DIR"):
            monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    write_run(tmp_path / "run", "trackio")
    name = f"run-{trackers.run_id(str(tmp_path / 'run'), STARTED)[:8]}"
    logs = sqlite_storage.SQLiteStorage.get_logs("trackers-test", name)
    found = {(k, row["step"]): v for row in logs for k, v in row.items()
             if "/" in k}
    assert found == EXPECTED
    config = sqlite_storage.SQLiteStorage.get_run_config("trackers-test", name)
    assert config["model"] == {"d_model": 32} and config["provenance"]["started"] == STARTED


@pytest.mark.slow  # a training run: ~15 s on 2 shared cores
def test_a_training_run_sends_its_lines_and_config_to_the_tracker(tmp_path, offline_wandb,
                                                                    load_config):
    """The loop's writer: train lines (every numeric figure) and config.json."""
    cfg = load_config("tiny.py", **{  # test_replay.py's run: its compiled step is cached
        "data.batch_size": 16, "num_train_steps": 5, "checkpoint_every_steps": 2,
        "log_every_steps": 2, "eval_every_steps": 0, "model.d_model": 32, "model.d_ff": 64,
        "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
        "metrics.tracker": "wandb"})
    loop.train_and_evaluate(cfg, str(tmp_path))
    history, config, _ = wandb_run(tmp_path)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for line in logged:
        for key, value in line.items():
            if key not in ("step", "split") and isinstance(value, int | float):
                assert history[(f"{line['split']}/{key}", line["step"])] == value, key
    assert {step for _, step in history} == {1, 2, 3, 4, 5}
    assert config["metrics"] == {"tracker": "wandb"} and config["model"]["d_model"] == 32


def test_tensorboard_stays_the_default_and_gets_the_config(tmp_path, load_config):
    assert metrics.tracker_name(load_config("tiny.py")) == "tensorboard"
    assert metrics.tracker_name({"seed": 0}) == "tensorboard"  # a config.json of before
    write_run(tmp_path, "tensorboard")
    from tensorboardX.proto import event_pb2

    tags = set()
    for name in glob.glob(f"{tmp_path}/tensorboard/events.out.tfevents.*"):
        data = open(name, "rb").read()
        offset = 0
        while offset < len(data):  # TFRecord: length, its crc, the record, its crc
            length = int.from_bytes(data[offset:offset + 8], "little")
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            tags |= {value.tag for value in event.summary.value}
            offset += 16 + length
    assert {key for key, _ in EXPECTED} | {"config/text_summary"} == tags


def test_bad_tracker_settings_are_one_line(load_config, monkeypatch):
    def refused(tracker, pattern, devices=8):
        cfg = load_config("tiny.py", **{"metrics.tracker": tracker})
        with pytest.raises(ValueError, match=pattern) as error:
            resolve(cfg, devices)
        assert "\n" not in str(error.value)

    refused("comet", r"metrics.tracker='comet' is not one of tensorboard, wandb, trackio")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    refused("wandb", r"needs the wandb package: pip install -e '.\[wandb\]'")
    # a finished run's config (decoding: no devices) needs no tracker package
    resolve(load_config("tiny.py", **{"metrics.tracker": "wandb"}))
