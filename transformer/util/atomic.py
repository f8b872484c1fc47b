"""`write_atomically`: a file replaced whole, on a local disk or a remote store such as gs://,
so that a reader (another process, another host) sees the old file or the new one, never part
of either."""

from __future__ import annotations

import os

from etils import epath


def write_atomically(path: str | os.PathLike, data: bytes | str) -> None:
    """Writes `data` (str: as UTF-8) to `path` through `<name>.tmp<pid>` beside it, then
    replaces `path` with it; the pid keeps processes writing the same file at once apart. The
    directory must exist."""
    target = epath.Path(path)
    tmp = target.parent / f"{target.name}.tmp{os.getpid()}"
    tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    tmp.replace(target)
