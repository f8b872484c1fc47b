"""transformer.util.atomic.write_atomically: the target is replaced whole from
`<name>.tmp<pid>-<token>` beside it (a reader sees the old file until then), locally and on gs://
(served from memory)."""

import os
import re
import threading

import pytest
from etils import epath
from etils.epath import gpath

from transformer.util import atomic


@pytest.fixture(params=["local", "gs"])
def directory(request, bucket, tmp_path, monkeypatch):
    """dir/ on the local disk or in the in-memory bucket, created; the working directory is
    tmp_path, where a remote path must create nothing."""
    monkeypatch.chdir(tmp_path)
    directory = epath.Path("gs://bucket/dir" if request.param == "gs" else tmp_path / "dir")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def test_a_file_is_replaced_whole_through_a_temporary_file_named_by_pid_and_token(
        directory, bucket, tmp_path, monkeypatch):
    target = directory / "record.json"
    target.write_text("old")
    seen = []  # (temporary file's name, its bytes, the target's bytes) at the replace
    replace = gpath.PosixGPath.replace

    def spy(self, destination):
        seen.append((self.name, self.read_bytes(), epath.Path(destination).read_bytes()))
        return replace(self, destination)

    monkeypatch.setattr(gpath.PosixGPath, "replace", spy)
    atomic.write_atomically(os.fspath(target), "naïve ✓")
    [(name, written, before)] = seen
    assert re.fullmatch(rf"record\.json\.tmp{os.getpid()}-[0-9a-f]{{8}}", name)
    assert (written, before) == ("naïve ✓".encode(), b"old")
    assert target.read_bytes() == "naïve ✓".encode()
    atomic.write_atomically(target, b"\x00\xff")  # bytes as given; an epath.Path target
    assert target.read_bytes() == b"\x00\xff"
    assert [p.name for p in directory.iterdir()] == ["record.json"]  # no temporary file left
    if str(directory).startswith("gs://"):
        assert not any(tmp_path.iterdir())  # nothing under a local `gs:` folder
        assert sorted(bucket) == ["gs://bucket/dir/record.json"]


def test_a_streamed_file_replaces_the_target_when_done_and_not_if_it_fails(directory):
    target = directory / "ids.npy"
    target.write_bytes(b"old")
    with atomic.replacing(os.fspath(target)) as f:
        f.write(b"new ")
        f.write(b"bytes")
        assert target.read_bytes() == b"old"  # until the block ends
    assert target.read_bytes() == b"new bytes"
    with pytest.raises(RuntimeError), atomic.replacing(target) as f:
        f.write(b"half")
        raise RuntimeError("the writer failed")
    assert target.read_bytes() == b"new bytes"
    assert [p.name for p in directory.iterdir()] == ["ids.npy"]  # the temporary removed


def test_two_threads_writing_one_target_at_once_leave_one_whole_file(directory):
    target = directory / "record.json"
    both_open = threading.Barrier(2, timeout=10)
    errors = []

    def write(payload):
        try:
            with atomic.replacing(target) as f:
                both_open.wait()  # each writer's temporary is open before either ends
                f.write(payload)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(c * 1000,)) for c in (b"a", b"b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_bytes() in (b"a" * 1000, b"b" * 1000)
    assert [p.name for p in directory.iterdir()] == ["record.json"]  # no temporary left
