"""Where figures go: `metrics.jsonl`, TensorBoard events, and a progress line on the console.

Only process 0 writes. A line of metrics.jsonl is one JSON object with "step" (optimizer updates
completed, 1-based) and "split" ("train", "validation", "test"). After a resume a step may
appear twice, and readers keep the last line per (step, split).

No line is lost to a kill: the loop calls `MetricWriter.sync` (flush and fsync of metrics.jsonl
and the TensorBoard events; before a local-tier save, flush only) before it starts a checkpoint
save, so every step a checkpoint covers has its lines on disk before the checkpoint exists. A
resumed run recomputes, and logs again, only steps after it. TensorBoard's events are otherwise
flushed by the first line TENSORBOARD_FLUSH_SECS after the last flush, not per line (a flush is
an fsync, and on gs:// an upload of the whole event file). tensorboardX writes events from a
queue on its own thread, which its flush does not wait for (only its close does), so the writer
hands each event to the file itself (`_write_in_caller`) and `sync` flushes that one file: a
process keeps one event file however often it saves. Where tensorboardX's internals differ,
`sync` closes the file instead and the next line opens another
(`events.out.tfevents.<second>.<host>.<n>`; TensorBoard reads every file in the directory). A
line torn by a kill mid-write (always of a step after the latest checkpoint) is cut off when the
next run opens the file. In a remote workdir (gs://, through etils.epath; objects there cannot
be appended to) the writer keeps the file's text and `sync` uploads it whole, so the same holds:
the object has every line a checkpoint covers.

`metrics.tracker` picks where the figures go besides metrics.jsonl: TensorBoard (the default),
Weights & Biases or trackio (`transformer.util.trackers`): every numeric figure, the per-layer
ones included, as `<split>/<name>`, and the run's config (TensorBoard: a text summary
"config"). Those two keep their own files and queues; `sync` covers metrics.jsonl and
TensorBoard's events only.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import logging
import math
import os
import sys
import time
import types

import jax
from etils import epath

from transformer.checkpoint import layout
from transformer.util import trackers

log = logging.getLogger("transformer")
TENSORBOARD_FLUSH_SECS = 30  # between the flushes of the event file, besides `sync` and close

# Dense bf16 peak FLOP/s per device, by a substring of `device.device_kind`.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
}


def peak_flops_per_device(device: jax.Device | None = None) -> float | None:
    """The device's dense bf16 peak, or None where unknown (e.g. CPU)."""
    kind = (device or jax.devices()[0]).device_kind
    for name, peak in PEAK_FLOPS.items():
        if name in kind:
            return peak
    return None


def tracker_name(cfg) -> str:
    """`metrics.tracker` of a config ("tensorboard" where it has no `metrics` section)."""
    return (cfg.get("metrics") or {}).get("tracker", "tensorboard")


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch where torch is not loaded yet:
    tensorboardX.writer imports torch (where installed: 1.8 CPU s, most of a tiny run's start)
    only to accept torch tensors, which nothing here passes. Later imports of torch work."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", False) is None:
            del sys.modules["torch"]
    return SummaryWriter


class MetricWriter:
    """Appends to metrics.jsonl and the `tracker` (process 0 only). Each line is handed to the
    operating system as it is written (kept in memory in a remote workdir), `sync` makes them
    durable. TensorBoard events go where tensorboardX puts them (gs:// needs
    google-cloud-storage), flushed by the first line TENSORBOARD_FLUSH_SECS after the last
    flush, at `sync` and at close. With
    `log_config` (the training loop) the tracker also gets config.json (config and
    provenance)."""

    def __init__(self, workdir: str, tracker: str = "tensorboard", *, log_config: bool = False):
        self.active = jax.process_index() == 0
        self._path = layout.path(workdir, layout.METRICS)
        self._tb_dir = layout.path(workdir, layout.TENSORBOARD)
        self._tb = self._file = self._tracker = None
        self._opened = 0  # event files opened so far
        self._event_file = None  # the open event file's path, where events are written in caller
        self._synced_events: set[str] = set()  # closed event files fsync'd by `sync`
        self._remote = layout.is_remote(workdir)
        self._tensorboard = trackers.check_tracker(tracker) == "tensorboard"
        if self.active:
            config = ((layout.read_config_file(workdir) or {}) if log_config or
                      not self._tensorboard else {})
            if self._remote:
                target = epath.Path(self._path)
                self._file = io.StringIO(target.read_text() if target.exists() else "")
                self._file.seek(0, io.SEEK_END)
            else:
                cut_torn_line(self._path)
                self._file = open(self._path, "a")
            if self._tensorboard:
                self._open_events()
                if config:
                    self._tb.add_text("config", f"```\n{json.dumps(config, indent=1)}\n```")
            else:
                self._tracker = trackers.open_tracker(
                    tracker, workdir, config, trackers.run_id(
                        workdir, config.get("provenance", {}).get("started")),
                    None if self._remote else os.path.abspath(workdir))

    def _open_events(self) -> None:
        """A new event file. After the first, its name ends in the count of those before it
        (the name holds the second it was opened, and opening a name again would empty it)."""
        SummaryWriter = _summary_writer_class()
        suffix = f".{self._opened}" if self._opened else ""
        self._tb = SummaryWriter(self._tb_dir, flush_secs=TENSORBOARD_FLUSH_SECS,
                                 filename_suffix=suffix)
        self._event_file = _write_in_caller(self._tb)
        self._flushed_at = time.monotonic()
        self._opened += 1

    def write(self, step: int, split: str, values: dict) -> None:
        if not self.active:
            return
        record = {"step": int(step), "split": split}
        record.update({k: _plain(v) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tracker is not None:
            self._tracker.log(step, {f"{split}/{k}": v for k, v in trackers.numeric(
                record).items() if k not in ("step", "split")})
            return
        for key, value in record.items():
            if key not in ("step", "split") and isinstance(value, int | float):
                if self._tb is None:
                    self._open_events()
                self._tb.add_scalar(f"{split}/{key}", value, step)
        if self._event_file is not None and (
                time.monotonic() - self._flushed_at >= TENSORBOARD_FLUSH_SECS):
            self._tb.flush()  # tensorboardX's thread flushes only what it wrote itself
            self._flushed_at = time.monotonic()

    def sync(self, *, durable: bool = True) -> None:
        """Every line written so far on disk (fsync of metrics.jsonl, of the event files not
        yet fsync'd and of their directories): call before a checkpoint save starts. The open
        event file is flushed and kept open (closed, the next line opening another, where
        tensorboardX still queues its events). With `durable=False` (a local-tier save) the
        lines reach the operating system, which keeps them through a kill of the process,
        without the fsyncs (a host crash: see docs/reliability.md, "Two tiers of
        checkpoints")."""
        if not self.active:
            return
        if self._event_file is not None:
            self._tb.flush()
        else:
            self._close_events()
        if self._remote:
            epath.Path(self._path).write_text(self._file.getvalue())
            return
        self._file.flush()
        if not durable:
            return
        os.fsync(self._file.fileno())
        if self._tensorboard:  # a closed event file is never written again: fsync'd once
            names = set(glob.glob(os.path.join(self._tb_dir, "events.out.tfevents.*")))
            for name in sorted(names - self._synced_events):
                _fsync_path(name)
            self._synced_events = names - {self._event_file}  # the open one: at every sync
            _fsync_path(self._tb_dir)
        _fsync_path(os.path.dirname(os.path.abspath(self._path)))

    def close(self) -> None:
        if self._file is not None:
            if self._remote:
                self.sync()
            self._close_events()
            self._file.close()
            self._file = None
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

    def _close_events(self) -> None:
        """Writes what tensorboardX's thread still holds, then flushes and closes the file."""
        if self._tb is not None:
            self._tb.close()
            self._tb = self._event_file = None


def _write_in_caller(writer) -> str | None:
    """Makes tensorboardX's `writer` write each event to its file in the calling thread,
    not through the queue its flush does not drain, so a flush puts every event on disk.
    The event file's path, or None where tensorboardX's internals differ (tested with 2.6)."""
    events = getattr(writer._get_file_writer(), "event_writer", None)
    file = getattr(events, "_ev_writer", None)
    if not (hasattr(events, "add_event") and hasattr(file, "write_event")
            and isinstance(getattr(file, "_file_name", None), str)):
        return None
    events.add_event = file.write_event
    return file._file_name


def _fsync_path(path: str) -> None:
    """fsync of a file or directory by name (a read-only descriptor suffices on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cut_torn_line(path: str) -> None:
    """Cuts a last line without its newline (a write cut short by a kill) off file `path`."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        block = min(size, 1 << 16)
        while True:
            f.seek(size - block)
            data = f.read(block)
            end = data.rfind(b"\n")
            if end >= 0 or block == size:
                break
            block = min(size, 2 * block)
        keep = size - block + end + 1
        log.warning("%s: cut off a torn last line (%d bytes, written when a run was killed)",
                    path, size - keep)
        f.truncate(keep)


def _plain(value):
    """JSON-ready Python scalars (numpy and jax scalars become int/float)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class Progress:
    """Throughput, ETA and data-wait accounting between two reports (`clock`: seconds, by
    default `time.perf_counter`; tests pass their own). `unit` names what the run counts in the
    console line ("tok", or "img" and "ex" for a classifier's images and examples). The metric
    keeps its name, `tokens_per_sec`.

    The ETA (`eta_seconds`) is the whole job's: the updates left at the current window's rate,
    the evaluations still due, and the scoring after training. An evaluation of kind `k`
    ("validation pass", "BLEU decode", "lm-eval tasks") is due every `every[k]` steps (0:
    never) and at the last step, and costs what the last one of its kind took (`evaluated`).
    Compiling (`compile_seconds`) is left out of an evaluation's cost: the first of a kind
    compiles, the later ones reuse its programs.

    The scoring after training is `final`: for each label the kind it is timed by and its
    count of items (sentences; for a decode the rows it decodes, `evaluation.decoded_rows`).
    It compiles afresh, so it costs the first compile of that kind plus the last one's
    seconds per item times the count (where either count is unknown, None: the last one's
    seconds). So the test decode is estimated as the latest validation BLEU decode's seconds
    per row times the test split's rows, plus the compile of the first decode; the test pass
    from the validation passes' seconds per sentence. A cost not measured yet (a
    BLEU decode before the first one) is left out: `eta_untimed` names it, and the console
    shows the ETA as a lower bound, `ETA >0:42:10 (not yet timed: BLEU decode, test decode)`.
    Where it errs: sentences differ in length (an early model's translations run long); the
    scoring's start (loading the checkpoint and data) is not counted, and it runs on one device
    (`evaluation.evaluate_run`): on several it may take longer.
    """

    def __init__(self, start_step: int, total_steps: int, clock=time.perf_counter, *,
                 unit: str = "tok", every: dict[str, int] | None = None,
                 final: dict[str, tuple[str, int | None]] | None = None):
        self.start_step, self.total_steps, self.unit = start_step, total_steps, unit
        self.every = {kind: int(n) for kind, n in (every or {}).items() if n}
        self.final = dict(final or {})
        self._clock = clock
        self._window_start = clock()
        self._data_wait = 0.0
        self._tokens = 0.0
        self._steps = 0
        self.measured: dict[str, tuple[int, float, int | None]] = {}  # kind: the last one's
        # step, seconds (not compiling) and sentences (`evaluated`)
        self.compiled: dict[str, float] = {}  # kind: the most seconds one of it compiled

    def add_step(self, data_wait_seconds: float) -> None:
        self._data_wait += data_wait_seconds
        self._steps += 1

    def add_tokens(self, tokens: float) -> None:
        self._tokens += tokens

    def exclude(self, seconds: float) -> None:
        """Leaves `seconds` (an evaluation) out of the current window's throughput."""
        self._window_start += seconds

    def evaluated(self, kind: str, step: int, seconds: float, items: int | None = None,
                  compiled: float = 0.0) -> None:
        """An evaluation of `kind` over `items` (None: not counted) ran at `step`
        and took `seconds`, `compiled` of them compiling: the cost of those still to come."""
        self.measured[kind] = (step, max(seconds - compiled, 0.0), items)
        self.compiled[kind] = max(self.compiled.get(kind, 0.0), compiled)

    @contextlib.contextmanager
    def timed(self, kind: str, step: int, items: int | None = None):
        """`evaluated` for the evaluation run inside, timed by `time.perf_counter` and
        `compile_seconds`; it may set `items` on what this yields, once it knows them."""
        timing = types.SimpleNamespace(items=items)
        started, compiling = time.perf_counter(), compile_seconds()
        yield timing
        self.evaluated(kind, step, time.perf_counter() - started, timing.items,
                       compile_seconds() - compiling)

    def remaining(self, step: int, steps_per_sec: float) -> tuple[float, list[str]]:
        """Seconds left after `step` at `steps_per_sec`, and the labels of the evaluations
        still to come whose cost is not measured yet (left out of the seconds)."""
        seconds = (self.total_steps - step) / max(steps_per_sec, 1e-9)
        untimed = []
        for kind, every in self.every.items():
            count = _due_count(every, max(step, self.measured.get(kind, (-1,))[0] + 1),
                               self.total_steps)
            if count and kind in self.measured:
                seconds += count * self.measured[kind][1]
            elif count:
                untimed.append(kind)
        for label, (kind, items) in self.final.items():
            if kind not in self.measured:
                untimed.append(label)
                continue
            _, took, counted = self.measured[kind]
            seconds += self.compiled[kind] + (took * items / counted if items and counted
                                              else took)
        return seconds, untimed

    def report(self, step: int) -> dict:
        """Figures since the last report. Resets the window."""
        elapsed = max(self._clock() - self._window_start, 1e-9)
        figures = {
            "tokens_per_sec": self._tokens / elapsed,
            "data_wait_fraction": self._data_wait / elapsed,
            "steps_per_sec": self._steps / elapsed,
        }
        figures["eta_seconds"], figures["eta_untimed"] = self.remaining(
            step, figures["steps_per_sec"])
        self._window_start = self._clock()
        self._data_wait = self._tokens = 0.0
        self._steps = 0
        return figures


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compiling = {"seconds": 0.0, "listening": False}


def compile_seconds() -> float:
    """Seconds this process has spent lowering and compiling XLA programs since the first call
    (`jax.monitoring`'s compile events; tracing, which nests, is left out)."""
    if not _compiling["listening"]:
        def listen(event: str, seconds: float, **_) -> None:
            if event in _COMPILE_EVENTS:
                _compiling["seconds"] += seconds

        jax.monitoring.register_event_duration_secs_listener(listen)
        _compiling["listening"] = True
    return _compiling["seconds"]


def _due_count(every: int, first: int, total: int) -> int:
    """How many of the steps `first`..`total` are due every `every` steps or are the last."""
    if first > total:
        return 0
    return total // every - (first - 1) // every + (1 if total % every else 0)


def format_progress(step: int, total: int, values: dict, unit: str = "tok") -> str:
    """One console line: step, loss, tokens (or images, examples: `unit`) per second, ETA (a
    lower bound, `>`, while `eta_untimed` names costs not measured yet), data wait, MFU, and a
    float16 run's loss scale and overflow-skipped updates."""
    eta = values.get("eta_seconds", 0.0)
    untimed = values.get("eta_untimed") or []
    hours, rest = divmod(int(eta), 3600)
    parts = [f"step {step}/{total}", f"loss {values['loss']:.4f}",
             f"lr {values['learning_rate']:.3g}", f"{values['tokens_per_sec']:,.0f} {unit}/s",
             f"ETA {'>' if untimed else ''}{hours}:{rest // 60:02d}:{rest % 60:02d}"
             + (f" (not yet timed: {', '.join(untimed)})" if untimed else ""),
             f"data wait {100 * values['data_wait_fraction']:.1f}%"]
    if "mfu" in values:
        parts.append(f"MFU {100 * values['mfu']:.1f}%")
    if "loss_scale" in values:
        parts.append(f"loss scale {float(values['loss_scale']):g} "
                     f"({int(values['skipped_overflow_steps'])} overflows skipped)")
    return " | ".join(parts)


def log_progress(step: int, total: int, values: dict, unit: str = "tok") -> None:
    if jax.process_index() == 0:
        log.info(format_progress(step, total, values, unit))


def log_evaluation(step: int, split: str, figures: dict, seconds: float) -> None:
    """One console line for an evaluation: loss, perplexity (a classifier: top-1 and top-5
    accuracy) and BLEU where computed."""
    if jax.process_index() != 0:
        return
    parts = [f"step {step} {split}"]
    if "loss" in figures:
        parts.append(f"loss {figures['loss']:.4f}")
    if "perplexity" in figures:
        parts.append(f"perplexity {figures['perplexity']:.2f}")
    for key, name in (("accuracy", "accuracy"), ("top5_accuracy", "top-5 accuracy")):
        if key in figures:
            parts.append(f"{name} {100 * figures[key]:.2f}%")
    if "bleu" in figures:
        parts += [f"BLEU {figures['bleu']:.2f}",
                  f"tokenized compound-split BLEU {figures['bleu_tok_compound']:.2f}",
                  sentences_scored(figures)]
    parts.append(f"{seconds:.0f} s")
    log.info(" | ".join(parts))


def sentences_scored(figures: dict) -> str:
    """`N sentences, all translated whole` or `N sentences, M of them truncated to the model's
    max_len (...)`, from `bleu_num_sentences` and `bleu_num_truncated`."""
    total = figures["bleu_num_sentences"]
    cut = figures["bleu_num_truncated"]
    return f"{total} sentences, " + (f"{cut} of them truncated to the model's max_len (scored "
                                     f"as translated)" if cut else "all translated whole")
