"""Progress of a long step on stderr, so that piped stdout stays clean: a tqdm bar with rate
and ETA on a terminal, a plain line every `interval` seconds otherwise (logs, CI).

    with progress.bar(len(sentences), "translating", unit="sentence") as bar:
        for batch in batches:
            ...
            bar.update(len(batch))
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

INTERVAL_SECONDS = 30.0


def clock(seconds: float) -> str:
    """h:mm:ss."""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Lines:
    """A line `<desc>: <done>/<total> <unit>s (<pct>), ETA h:mm:ss, <rate>/s` every `interval`
    seconds (without total, pct and ETA when `total` is None), and a last one when something
    was printed before."""

    def __init__(self, total: int | None, desc: str, unit: str, interval: float, stream):
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.stream, self.done, self.shown = stream, 0, None
        self.start = self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        if time.monotonic() - self.last >= self.interval:
            self._print()

    def _print(self) -> None:
        self.last = time.monotonic()
        elapsed = max(self.last - self.start, 1e-9)
        rate = self.done / elapsed
        done = f"{self.done:,} {self.unit}s"
        if self.total:
            eta = (self.total - self.done) / rate if rate else 0.0
            done = (f"{self.done:,}/{self.total:,} {self.unit}s "
                    f"({100 * self.done / self.total:.0f}%), ETA {clock(eta)}")
        print(f"{time.strftime('%H:%M:%S')} {self.desc}: {done}, {rate:,.1f}/s", file=self.stream,
              flush=True)
        self.shown = self.done

    def close(self) -> None:
        if self.shown is not None and self.shown != self.done:
            self._print()


@contextlib.contextmanager
def bar(total: int | None, desc: str, *, unit: str = "item", show: bool = True,
        interval: float = INTERVAL_SECONDS, stream=None) -> Iterator:
    """A progress counter of `total` items (None: unknown) with `.update(n)`: tqdm when
    `stream` (default stderr) is a terminal, `Lines` otherwise. Silent unless `show`."""
    stream = sys.stderr if stream is None else stream
    if not show:
        interval = float("inf")
    if show and stream.isatty():
        from tqdm import tqdm

        counter = tqdm(total=total, desc=desc, unit=unit, file=stream, leave=False,
                       dynamic_ncols=True)
    else:
        counter = Lines(total, desc, unit, interval, stream)
    try:
        yield counter
    finally:
        counter.close()
