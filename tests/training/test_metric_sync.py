"""`MetricWriter.sync` before a checkpoint save (training/metrics.py): a persistent save's sync
fsyncs metrics.jsonl and the one event file the process keeps open; a local-tier save's
(`durable=False`) hands the lines to the operating system without an fsync. However often it
syncs, a process writes one event file."""

import json
import os
import subprocess
import sys

from transformer.training import metrics


def test_sync_fsyncs_each_event_file_once_and_a_local_sync_none(tmp_path, monkeypatch):
    fsynced = []  # by name: the writer's own fsyncs (tensorboardX's close does one of its own)
    monkeypatch.setattr(metrics, "_fsync_path", fsynced.append)
    fsync = os.fsync

    def named_fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith("metrics.jsonl"):
            fsynced.append(name)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", named_fsync)
    events = tmp_path / "tensorboard"
    writer = metrics.MetricWriter(str(tmp_path))

    def synced_files(step: int, durable: bool) -> list[str]:
        writer.write(step, "train", {"loss": 1.0 / step})
        fsynced.clear()
        writer.sync(durable=durable)
        return sorted(os.path.basename(p) for p in fsynced if p.startswith(str(events) + "/"))

    first = synced_files(1, durable=True)
    assert len(first) == 1 and len(list(events.iterdir())) == 1  # the one event file
    assert str(tmp_path / "metrics.jsonl") in fsynced
    assert synced_files(2, durable=False) == [] and fsynced == []  # a local save: no fsync
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # yet every line is written
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert synced_files(3, durable=True) == first  # the same file, fsync'd again
    for step in range(4, 30):  # a local save every step: still that one file
        synced_files(step, durable=False)
    assert len(list(events.iterdir())) == 1
    writer.close()
    assert len(list(events.iterdir())) == 1


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports torch, where installed, only to accept its tensors: a train.py
    process (a fresh interpreter, as here) writes events without paying that import, and a later
    `import torch` still finds torch."""
    code = ("import sys\n"
            "from transformer.training import metrics\n"
            "writer = metrics.MetricWriter(sys.argv[1])\n"
            "writer.write(1, 'train', {'loss': 1.0})\n"
            "writer.close()\n"
            "print('torch' in sys.modules, sys.modules.get('torch', 'unset'))\n")
    found = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert found.returncode == 0, found.stderr[-3000:]
    assert found.stdout.split() == ["False", "unset"]
    assert len(list((tmp_path / "tensorboard").iterdir())) == 1
