"""Goodput: the share of a run's wall time spent in train steps that count, against compiling,
checkpoint saves and restores, waiting for data, evaluation, start-up and the work a restart
recomputed.

`Goodput` times one process's segment of a run (from its start to its exit) by part; the loop
keeps the run's totals over its earlier segments in the checkpoint's data item (`run`,
`carry`), so a resumed run reports the whole run. A restart recomputes the steps logged
after the checkpoint it resumes from: `recomputed_seconds` reads their times back from
metrics.jsonl (each train line's 1 / `steps_per_sec`) and counts them lost.

`figures` are the keys the loop adds to a train line at each log step (metrics.jsonl and the
tracker): the run's and this segment's goodput (`goodput/run`, `goodput/segment`), the segment's
index (`goodput/segment_index`: 0 until the first restart, one more per restart) and the seconds
by part, the run's (`goodput_seconds/<part>`) and this segment's
(`goodput_segment_seconds/<part>`), parts `steps`, PARTS and `total`.
"""

from __future__ import annotations

import contextlib
import json
import re
import time

from etils import epath

# The parts of a run's wall time besides its productive steps.
PARTS = ("compile", "checkpoint", "data_wait", "evaluation", "startup", "restart")
STATE_KEY = "goodput_seconds"  # the checkpoint's data item: the run's totals so far
SEGMENT = "segment"  # in it: the index of the segment that saved it
_STEP = re.compile(r'\{"step": (\d+), "split": "train"')


class Goodput:
    """Seconds by part in this segment (`clock`: seconds, `time.perf_counter` by default),
    and `carried`, the run's totals before it (`carry`)."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._start = clock()
        self.carried: dict[str, float] = {}
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.index = 0  # this segment's: the restarts before it

    def carry(self, totals: dict, recomputed: float) -> None:
        """Resuming: the run's totals as of its checkpoint (`run` saved), and the seconds of
        the steps after it that the restart recomputes (`recomputed_seconds`), lost. A
        checkpoint without a segment index (written before it was kept) counts as segment 0."""
        self.index = int(totals.get(SEGMENT, 0)) + 1
        self.carried = {k: float(v) for k, v in totals.items() if k != SEGMENT}
        for key in ("restart", "total"):
            self.carried[key] = self.carried.get(key, 0.0) + recomputed

    def start_training(self) -> None:
        """The loop starts: the time so far that no part took was start-up (the data source,
        the mesh, the initial state)."""
        self.seconds["startup"] += self._clock() - self._start - sum(self.seconds.values())

    @contextlib.contextmanager
    def timed(self, part: str):
        """Adds the time the block takes to `part`."""
        started = self._clock()
        try:
            yield
        finally:
            self.seconds[part] += self._clock() - started

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def segment(self) -> dict[str, float]:
        """This segment's seconds: each part, `steps` (the rest: productive steps, the loop's
        own bookkeeping included) and `total`."""
        total = self._clock() - self._start
        return self.seconds | {"steps": max(total - sum(self.seconds.values()), 0.0),
                               "total": total}

    def run(self, segment: dict[str, float] | None = None) -> dict[str, float]:
        """The run's seconds so far: the carried totals plus this segment's (`segment`, read
        now where not given)."""
        return {k: self.carried.get(k, 0.0) + v for k, v in (segment or self.segment()).items()}

    def state(self) -> dict:
        """What a checkpoint keeps (STATE_KEY): the run's seconds and this segment's index."""
        return self.run() | {SEGMENT: self.index}

    def figures(self) -> dict[str, float]:
        """The metric keys of a train line (the module's docstring)."""
        segment = self.segment()
        run = self.run(segment)
        figures = {"goodput/run": run["steps"] / max(run["total"], 1e-9),
                   "goodput/segment": segment["steps"] / max(segment["total"], 1e-9),
                   "goodput/segment_index": self.index}
        figures |= {f"goodput_seconds/{k}": v for k, v in run.items()}
        return figures | {f"goodput_segment_seconds/{k}": v for k, v in segment.items()}

    def summary(self) -> str:
        """The line logged at exit: this segment's and the run's goodput and parts."""
        def parts(seconds):
            return ", ".join(f"{k.replace('_', ' ')} {seconds[k]:.1f} s" for k in
                             ("steps", *PARTS) if seconds[k] or k == "steps")

        segment = self.segment()
        run = self.run(segment)
        return (f"goodput {100 * run['steps'] / max(run['total'], 1e-9):.1f}% of the run's "
                f"{run['total']:.1f} s ({parts(run)}); this process "
                f"{100 * segment['steps'] / max(segment['total'], 1e-9):.1f}% of "
                f"{segment['total']:.1f} s ({parts(segment)})")


def recomputed_seconds(metrics_path: str, restored_step: int) -> float:
    """The seconds of the train steps after `restored_step` that metrics.jsonl logged (the last
    line per step): the work a restart from that step recomputes."""
    path = epath.Path(metrics_path)
    if not path.exists():
        return 0.0
    times: dict[int, float] = {}
    with path.open() as f:
        for line in f:
            match = _STEP.match(line)
            if match and int(match.group(1)) > restored_step:
                try:
                    rate = json.loads(line).get("steps_per_sec")
                except json.JSONDecodeError:  # a torn last line
                    continue
                if rate:
                    times[int(match.group(1))] = 1.0 / rate
    return sum(times.values())
