"""config.json, metrics.jsonl and the eval texts in a workdir on gs:// (served from memory) land
in the bucket, and nothing under a local `gs:` folder; the same calls on a local workdir give the
same files."""

import json

import numpy as np
import pytest
from etils import epath

from transformer.checkpoint import workdir as workdir_lib
from transformer.training import evaluation, metrics


def _train_line(step):
    return {name: float(step) for name in workdir_lib.TRAIN_METRICS} | {"loss": np.float32(step)}


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
        text = epath.Path(workdir_lib.path(workdir, workdir_lib.METRICS)).read_text()
        return [(line["step"], line["split"], line["loss"]) for line in map(json.loads,
                                                                            text.splitlines())]

    values = {"seed": 3, "model": {"d_model": 8}, "mesh": {"data": 1, "fsdp": -1, "tensor": 1},
              "num_train_steps": 3, "checkpoint_every_steps": 2}
    provenance = {"vocabulary": "sentencepiece sha256=" + "ab" * 32}
    workdir_lib.write_config(workdir, values, provenance)
    assert workdir_lib.read_config_file(workdir) == values | {"provenance": provenance}
    assert workdir_lib.load_config(workdir).to_dict() == values
    assert workdir_lib.recorded_vocabulary(workdir) == "ab" * 32

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
    assert workdir_lib.check(workdir) == []

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
    eval_dir = epath.Path(workdir_lib.path(workdir, workdir_lib.EVAL))
    assert sorted(path.name for path in eval_dir.iterdir()) == [
        "test.step4.source.txt", "test.step4.translation.txt"]
    source = (eval_dir / "test.step4.source.txt").read_bytes()
    assert source == "Guten Morgen.\nGrüß Gott!\n".encode()  # UTF-8 whatever the locale
    assert (eval_dir / "test.step4.translation.txt").read_text() == "Good morning.\n\n"
    if remote:
        assert list(tmp_path.iterdir()) == []
