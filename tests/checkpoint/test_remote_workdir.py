"""config.json, metrics.jsonl and the eval texts in a workdir on gs:// (served from memory) land
in the bucket, and nothing under a local `gs:` folder; the same calls on a local workdir give the
same files."""

import json

import numpy as np
import pytest
from etils import epath

from transformer.checkpoint import layout
from transformer.training import evaluation, metrics


def _train_line(step):
    return {name: float(step) for name in layout.TRAIN_METRICS} | {"loss": np.float32(step)}


@pytest.mark.parametrize("remote", [False, True])
def test_config_and_metrics_land_in_the_workdir_whatever_its_scheme(remote, bucket, tmp_path,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)  # a remote workdir must create nothing here
    workdir = "gs://bucket/run" if remote else str(tmp_path / "run")
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)  # as train_and_evaluate does

    def files():  # what was written, local paths named as the bucket's
        local = sorted(str(p.relative_to(tmp_path)).replace("run", "gs://bucket/run", 1)
                       for p in tmp_path.rglob("*") if p.is_file())
        return sorted(bucket) + local if remote else local

    def metric_lines():
        text = epath.Path(layout.path(workdir, layout.METRICS)).read_text()
        return [(line["step"], line["split"], line["loss"]) for line in map(json.loads,
                                                                            text.splitlines())]

    values = {"seed": 3, "model": {"d_model": 8}, "mesh": {"data": 1, "fsdp": -1, "tensor": 1},
              "num_train_steps": 3, "checkpoint_every_steps": 2}
    provenance = {"vocabulary": "sentencepiece sha256=" + "ab" * 32}
    layout.write_config(workdir, values, provenance)
    assert layout.read_config_file(workdir) == values | {"provenance": provenance}
    assert layout.load_config(workdir).to_dict() == values
    assert layout.recorded_vocabulary(workdir) == "ab" * 32

    writer = metrics.MetricWriter(workdir)
    writer.write(1, "train", _train_line(1))
    writer.write(2, "train", _train_line(2))
    writer.sync()  # before a checkpoint save: both lines are in the workdir
    assert metric_lines() == [(1, "train", 1.0), (2, "train", 2.0)]
    writer.write(3, "train", _train_line(3))
    writer.close()
    resumed = metrics.MetricWriter(workdir)  # appends after the lines already there
    resumed.write(3, "validation", {"loss": 0.5, "perplexity": float(np.exp(0.5))})
    resumed.close()
    assert metric_lines() == [(1, "train", 1.0), (2, "train", 2.0), (3, "train", 3.0),
                              (3, "validation", 0.5)]
    assert layout.check(workdir) == []

    written = files()
    events = [name for name in written if name.startswith("gs://bucket/run/tensorboard/events.")]
    assert events  # one event file per writer (named by the second it was opened)
    assert [name for name in written if name not in events] == [
        "gs://bucket/run/config.json", "gs://bucket/run/metrics.jsonl"]


@pytest.mark.parametrize("remote", [False, True])
def test_eval_texts_land_in_the_workdir_whatever_its_scheme(remote, bucket, tmp_path,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)  # a remote workdir must create nothing here
    workdir = "gs://bucket/run" if remote else str(tmp_path / "run")
    texts = {"source": ["Guten Morgen.", "Grüß Gott!"], "translation": ["Good morning.", ""]}
    evaluation.save_texts(workdir, "test.step4", texts)
    evaluation.save_texts(workdir, "test.step4", texts)  # again: the same files, replaced
    eval_dir = epath.Path(layout.path(workdir, layout.EVAL))
    assert sorted(path.name for path in eval_dir.iterdir()) == [
        "test.step4.source.txt", "test.step4.translation.txt"]
    source = (eval_dir / "test.step4.source.txt").read_bytes()
    assert source == "Guten Morgen.\nGrüß Gott!\n".encode()  # UTF-8 whatever the locale
    assert (eval_dir / "test.step4.translation.txt").read_text() == "Good morning.\n\n"
    if remote:
        assert list(tmp_path.iterdir()) == []


def test_tensorboard_is_uploaded_on_a_cadence_and_at_sync_not_per_line(bucket, tmp_path,
                                                                      monkeypatch):
    """A flush of a gs:// event file uploads the whole file (tensorboardX's GCSRecordWriter):
    not once per metrics line, but on a line TENSORBOARD_FLUSH_SECS after the last upload, at
    `sync` and at close."""
    import time
    import types

    from tensorboardX import record_writer

    monkeypatch.chdir(tmp_path)
    uploads = []  # the number of records in the event file at each upload
    factory = record_writer.REGISTERED_FACTORIES["gs"]

    class Counted:
        def __init__(self, path):
            self.events = factory.open(path)

        def write(self, data):
            self.events.write(data)

        def flush(self):
            uploads.append(_records(self.events.data))
            self.events.flush()

        close = flush

    monkeypatch.setitem(record_writer.REGISTERED_FACTORIES, "gs", types.SimpleNamespace(
        open=Counted, directory_check=lambda path: None))
    monkeypatch.setattr(metrics, "TENSORBOARD_FLUSH_SECS", 3600)
    writer = metrics.MetricWriter("gs://bucket/run")
    for step in range(1, 41):
        writer.write(step, "train", _train_line(step))
    time.sleep(0.5)  # tensorboardX's thread writes what it was given
    assert len(uploads) <= 1  # its first event only; was 40, one per line
    writer.sync()
    writer.close()
    assert uploads[-1] == 1 + 40 * len(layout.TRAIN_METRICS)  # file version + scalars
    text = epath.Path("gs://bucket/run/metrics.jsonl").read_text()
    assert [json.loads(line)["step"] for line in text.splitlines()] == list(range(1, 41))

    uploads.clear()  # and on the cadence, without a sync
    monkeypatch.setattr(metrics, "TENSORBOARD_FLUSH_SECS", 0.2)
    writer = metrics.MetricWriter("gs://bucket/run")
    writer.write(41, "train", _train_line(41))
    time.sleep(0.4)
    writer.write(42, "train", _train_line(42))
    deadline = time.monotonic() + 10
    while (not uploads or uploads[-1] < 1 + 2 * len(layout.TRAIN_METRICS)) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uploads[-1] == 1 + 2 * len(layout.TRAIN_METRICS)
    writer.close()


def _records(data: bytes) -> int:
    """The records of a TFRecord file's bytes (length, its crc, data, its crc)."""
    count = offset = 0
    while offset < len(data):
        offset += 16 + int.from_bytes(data[offset:offset + 8], "little")
        count += 1
    return count
