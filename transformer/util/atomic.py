"""A file replaced whole, on a local disk or a remote store such as gs://, so that a reader
(another process, another host) sees the old file or the new one, never part of either:
`write_atomically` for bytes or text at hand, `replacing` for a file written as a stream."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import IO

from etils import epath


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A binary file open for writing at `<name>.tmp<pid>-<token>` beside `path`, which replaces
    `path` when the block ends (and does not if it raises, removing the temporary). The pid and
    a random token keep writers of the same file apart, processes, hosts and threads alike.
    The directory must exist."""
    target = epath.Path(path)
    tmp = target.parent / f"{target.name}.tmp{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with tmp.open("wb") as f:
            yield f
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(target)


def write_atomically(path: str | os.PathLike, data: bytes | str) -> None:
    """Writes `data` (str: as UTF-8) to `path` through `replacing`."""
    with replacing(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
