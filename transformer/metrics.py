"""Where figures go: `metrics.jsonl`, TensorBoard events, and a progress line on the console.

Only process 0 writes. A line of metrics.jsonl is one JSON object with "step" (optimizer updates
completed, 1-based) and "split" ("train", "validation", "test"); after a resume a step may
appear twice, and readers keep the last line per (step, split).
"""

from __future__ import annotations

import json
import logging
import math
import time

import jax

from transformer import workdir as workdir_lib

log = logging.getLogger("transformer")

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


class MetricWriter:
    """Appends to metrics.jsonl and TensorBoard (process 0 only)."""

    def __init__(self, workdir: str):
        self.active = jax.process_index() == 0
        self._path = workdir_lib.path(workdir, workdir_lib.METRICS)
        self._tb = None
        if self.active:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(workdir_lib.path(workdir, workdir_lib.TENSORBOARD))

    def write(self, step: int, split: str, values: dict) -> None:
        if not self.active:
            return
        record = {"step": int(step), "split": split}
        record.update({k: _plain(v) for k, v in values.items()})
        with open(self._path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key not in ("step", "split") and isinstance(value, int | float):
                self._tb.add_scalar(f"{split}/{key}", value, step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _plain(value):
    """JSON-ready Python scalars (numpy and jax scalars become int/float)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class Progress:
    """Throughput, ETA and data-wait accounting between two reports (`clock`: seconds, by
    default `time.perf_counter`; tests pass their own)."""

    def __init__(self, start_step: int, total_steps: int, clock=time.perf_counter):
        self.start_step, self.total_steps = start_step, total_steps
        self._clock = clock
        self._window_start = clock()
        self._data_wait = 0.0
        self._tokens = 0.0
        self._steps = 0

    def add_step(self, data_wait_seconds: float) -> None:
        self._data_wait += data_wait_seconds
        self._steps += 1

    def add_tokens(self, tokens: float) -> None:
        self._tokens += tokens

    def exclude(self, seconds: float) -> None:
        """Leaves `seconds` (an evaluation) out of the current window's throughput."""
        self._window_start += seconds

    def report(self, step: int) -> dict:
        """Figures since the last report; resets the window."""
        elapsed = max(self._clock() - self._window_start, 1e-9)
        figures = {
            "tokens_per_sec": self._tokens / elapsed,
            "data_wait_fraction": self._data_wait / elapsed,
            "steps_per_sec": self._steps / elapsed,
        }
        figures["eta_seconds"] = (self.total_steps - step) / max(figures["steps_per_sec"], 1e-9)
        self._window_start = self._clock()
        self._data_wait = self._tokens = 0.0
        self._steps = 0
        return figures


def format_progress(step: int, total: int, values: dict) -> str:
    """One console line: step, loss, tokens/s, ETA, data wait, MFU."""
    eta = values.get("eta_seconds", 0.0)
    hours, rest = divmod(int(eta), 3600)
    parts = [f"step {step}/{total}", f"loss {values['loss']:.4f}",
             f"lr {values['learning_rate']:.3g}", f"{values['tokens_per_sec']:,.0f} tok/s",
             f"ETA {hours}:{rest // 60:02d}:{rest % 60:02d}",
             f"data wait {100 * values['data_wait_fraction']:.1f}%"]
    if "mfu" in values:
        parts.append(f"MFU {100 * values['mfu']:.1f}%")
    return " | ".join(parts)


def log_progress(step: int, total: int, values: dict) -> None:
    if jax.process_index() == 0:
        log.info(format_progress(step, total, values))


def log_evaluation(step: int, split: str, figures: dict, seconds: float) -> None:
    """One console line for an evaluation: loss, perplexity and BLEU where computed."""
    if jax.process_index() != 0:
        return
    parts = [f"step {step} {split}"]
    if "loss" in figures:
        parts += [f"loss {figures['loss']:.4f}", f"perplexity {figures['perplexity']:.2f}"]
    if "bleu" in figures:
        parts += [f"BLEU {figures['bleu']:.2f}",
                  f"tokenized compound-split BLEU {figures['bleu_tok_compound']:.2f}",
                  sentences_scored(figures)]
    parts.append(f"{seconds:.0f} s")
    log.info(" | ".join(parts))


def sentences_scored(figures: dict) -> str:
    """`N sentences, all translated whole` or `N sentences, M of them truncated to the model's
    max_len (...)`, from `bleu_num_sentences` and `bleu_num_truncated`."""
    total, cut = figures["bleu_num_sentences"], figures["bleu_num_truncated"]
    return f"{total} sentences, " + (f"{cut} of them truncated to the model's max_len (scored "
                                     f"as translated)" if cut else "all translated whole")
