"""Slow steps and hangs named, never silent: `slow_step_factor` and `step_timeout_seconds`.

The training loop calls `Watchdog.beat(step, outputs)` once step `step` is dispatched, and
`rest()` after an evaluation or a checkpoint save (time that is no step's). `beat` waits for
the previous step's outputs, so the host stays one step ahead of the device (the next batch is
read while the device computes) and the time between beats is a step's time on the device.
A thread of its own watches the step in progress (from its beat to the next):

- **Slow step.** Once it has run `slow_step_factor` times the median of the last `WINDOW`
  steps, every thread's stack is dumped to stderr (`faulthandler`) with one line naming the
  step and this process. When it ends, the processes post their own time outside the wait for
  the device to the coordination service's key-value store and each logs the one that spent
  the most: the straggler the others waited for.
- **Hang.** A step that has not ended after `step_timeout_seconds` (a collective that never
  returns, a device or a reader that hangs) dumps the stacks and ends the run with one line
  naming the processes that did not arrive at that step (each posts the step it starts), and
  tells the others (`distributed.FailureNotices`), which stop too.
"""

from __future__ import annotations

import collections
import faulthandler
import logging
import os
import statistics
import sys
import threading
import time

import jax

from transformer.parallel.distributed import FailureNotices

log = logging.getLogger("transformer")
WINDOW = 100  # steps whose median a step is compared with
WARMUP = 5  # steps measured before any is judged (the first ones compile, warm caches)
POLL_S = 0.2  # how often the thread looks at the step in progress
ARRIVED_KEY = "transformer/watchdog/arrived/{}"  # process p's latest step
OUTSIDE_KEY = "transformer/watchdog/outside/{}/{}"  # step, process: its time outside the wait
GATHER_MS = 5000  # how long a slow step's report waits for each peer's figure


class Watchdog:
    """Watches the steps of this process (see the module's docstring). `client` is the
    coordination service's client with several processes (None: one). `on_hang(line)` ends
    the run (default: tell the peers, print the line, exit 1); tests pass their own. The
    settings are checked with the config (`transformer.config`: one line each)."""

    def __init__(self, *, slow_step_factor: float, step_timeout_seconds: float,
                 client=None, process: int = 0, processes: int = 1, on_hang=None,
                 clock=time.monotonic, stream=None):
        self.factor, self.timeout = float(slow_step_factor), float(step_timeout_seconds)
        self.client, self.process, self.processes = client, process, processes
        self._on_hang = on_hang or self._end_run
        self._clock, self._stream = clock, stream or sys.stderr
        self._times: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._outputs: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._step, self._start = None, 0.0  # the step in progress and its start
        self._judged = True  # whether the step in progress is timed (not after a rest)
        self._slow: tuple[int, float] | None = None  # the step the thread found slow, median
        self._stop = threading.Event()
        self._thread = None
        if self.factor or self.timeout:
            self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
            self._thread.start()

    @classmethod
    def for_run(cls, cfg) -> Watchdog:
        """The watchdog of a training run: the config's settings, this process's peers."""
        client = None
        if jax.process_count() > 1:
            from jax._src import distributed  # jax.distributed's client: no public handle

            client = distributed.global_state.client
        return cls(slow_step_factor=float(cfg.get("slow_step_factor", 0.0)),
                   step_timeout_seconds=float(cfg.get("step_timeout_seconds", 0.0)),
                   client=client, process=jax.process_index(), processes=jax.process_count())

    def beat(self, step: int, outputs=None) -> None:
        """Step `step` is dispatched, its `outputs` (waited for at the next beat)."""
        if self._thread is None:
            return
        waited = 0.0
        if outputs is not None:
            self._outputs.append(outputs)
        if len(self._outputs) > 1:
            started = self._clock()
            jax.block_until_ready(self._outputs.popleft())
            waited = self._clock() - started
        now = self._clock()
        with self._lock:
            ended, elapsed, judged = self._step, now - self._start, self._judged
            slow, self._slow = self._slow, None
            outside = elapsed - waited
            self._step, self._start, self._judged = step, now, True
        if ended is not None and judged:
            self._times.append(elapsed)
        if slow is not None and slow[0] == ended:
            self._name_straggler(ended, elapsed, slow[1], outside)
        if self.client is not None:
            self.client.key_value_set(ARRIVED_KEY.format(self.process), str(step),
                                      allow_overwrite=True)

    def rest(self) -> None:
        """The time since the last beat (an evaluation, a save) is no step's: not timed."""
        with self._lock:
            self._start, self._judged = self._clock(), False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S)

    # ----------------------------------------------------------------- the thread

    def _median(self) -> float | None:
        return statistics.median(self._times) if len(self._times) >= WARMUP else None

    def _watch(self) -> None:
        dumped = None
        while not self._stop.wait(POLL_S):
            with self._lock:
                step, elapsed, judged = self._step, self._clock() - self._start, self._judged
            if step is None:
                continue
            median = self._median()
            if (self.factor and judged and median and dumped != step
                    and elapsed > self.factor * median):
                dumped = step
                with self._lock:
                    if self._step == step:
                        self._slow = (step, median)
                self._dump(f"step {step} has run {elapsed:.1f} s, {elapsed / median:.1f}x the "
                           f"median {median:.2f} s of the last {len(self._times)} steps "
                           f"(slow_step_factor={self.factor:g}); the stacks of every thread of "
                           f"process {self.process} follow")
            if self.timeout and elapsed > self.timeout:
                self._on_hang(self._hang_line(step, elapsed))
                return

    def _dump(self, line: str) -> None:
        log.warning(line)
        for handler in log.handlers:
            handler.flush()
        faulthandler.dump_traceback(file=self._stream, all_threads=True)
        self._stream.flush()

    def _hang_line(self, step: int, elapsed: float) -> str:
        """Who did not arrive: the processes whose latest step is behind the furthest one's
        (each posts the step it dispatches)."""
        if self.client is None:
            who = "the device or a host thread of process 0 hangs (its stacks are above)"
        else:
            latest = {}
            for p in range(self.processes):
                try:
                    latest[p] = int(self.client.key_value_try_get(ARRIVED_KEY.format(p)))
                except Exception:  # never posted
                    latest[p] = 0
            front = max(latest.values())
            missing = [f"{p} (at step {latest[p]})" if latest[p] else f"{p} (no step)"
                       for p in range(self.processes) if latest[p] < front]
            who = (f"process{'es' if len(missing) > 1 else ''} {', '.join(missing)} did not "
                   f"arrive at step {front}" if missing else
                   f"every process arrived at step {front}: a collective or a device of the "
                   f"step hangs")
        return (f"step {step} did not end within step_timeout_seconds={self.timeout:g} "
                f"({elapsed:.0f} s): {who}; stopping the run")

    def _end_run(self, line: str) -> None:
        """Dumps the stacks, tells the peers (they stop too), prints the line, exits 1."""
        self._dump(f"process {self.process}: {line}; the stacks of every thread follow")
        if self.client is not None:
            try:
                self.client.key_value_set(FailureNotices.KEY,
                                          f"{self.process}\tStepTimeout: {line}")
            except Exception:  # another process posted first
                pass
        print(f"error: {line}", file=sys.stderr, flush=True)
        if self.client is not None and self.process == 0:  # it hosts the service: the others
            time.sleep(FailureNotices.GRACE_S)  # read the notice and stop first
        os._exit(1)

    # ----------------------------------------------------------------- naming the straggler

    def _name_straggler(self, step: int, elapsed: float, median: float,
                        outside: float) -> None:
        """Logs which process spent the most of slow step `step` outside the wait for the
        device (each posts its own figure; with one process, this one)."""
        figures = {self.process: outside}
        if self.client is not None:
            self.client.key_value_set(OUTSIDE_KEY.format(step, self.process), f"{outside:.6f}",
                                      allow_overwrite=True)
            deadline = self._clock() + GATHER_MS / 1000  # one wait for all the peers
            for p in range(self.processes):
                if p != self.process:
                    left_ms = max(1, int(1000 * (deadline - self._clock())))
                    try:
                        figures[p] = float(self.client.blocking_key_value_get(
                            OUTSIDE_KEY.format(step, p), left_ms))
                    except Exception:  # it did not find the step slow, or is gone
                        pass
        slowest = max(figures, key=figures.get)
        log.warning("step %d took %.1f s, %.1fx the median %.2f s: the slowest process is %d "
                    "(%.1f s outside the wait for the device; %d of %d processes reported)",
                    step, elapsed, elapsed / median, median, slowest, figures[slowest],
                    len(figures), self.processes)
