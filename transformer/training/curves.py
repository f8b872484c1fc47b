"""A run's metrics.jsonl read back: the curves per split and metric, the hours of training
behind each step, and the figure of several runs' curves."""

from __future__ import annotations

import json
import os

import numpy as np
from etils import epath

from transformer.checkpoint import workdir as workdir_lib
from transformer.util.plotting import pyplot, save

CURVES = (("loss", "loss (NLL per target token)"), ("perplexity", "perplexity"),
          ("learning_rate", "learning rate"), ("bleu", "sacreBLEU"),
          ("tokens_per_sec", "tokens/s (non-pad target; images or examples for a classifier)"),
          ("accuracy", "accuracy (a classifier)"))
ROUTER_CURVES = (("expert_load_max", "most-loaded expert's share of assignments"),
                 ("expert_load_min", "least-loaded expert's share of assignments"),
                 ("moe_dropped", "assignments dropped over capacity"))  # routed runs only


def read_metrics(workdir: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """`{split: {metric: [(step, value), ...]}}` from `<workdir>/metrics.jsonl`, the last line
    per (step, split) winning, steps ascending; `workdir` local or remote (gs://)."""
    if not epath.Path(workdir).is_dir():
        raise ValueError(f"--workdir={workdir} is not a directory: give a training run's workdir")
    path = workdir_lib.path(workdir, workdir_lib.METRICS)
    if not epath.Path(path).exists():
        raise ValueError(f"{path} does not exist: is {workdir} a training workdir?")
    last: dict[tuple[int, str], dict] = {}
    with epath.Path(path).open() as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{number} is not a JSON line") from None
            last[(int(record["step"]), record["split"])] = record
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for (step, split), record in sorted(last.items()):
        for key, value in record.items():
            if key not in ("step", "split") and isinstance(value, int | float):
                curves.setdefault(split, {}).setdefault(key, []).append((step, float(value)))
    return curves


def training_hours(curves: dict, workdir: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, hours) of a run's train lines (`read_metrics`), from (0, 0): the hours of
    training up to the end of each step, the sum of the steps' times, so pauses, resumes and
    evaluations are left out. A step's time is 1 / steps_per_sec; lines written before that
    metric existed give target_tokens_per_update / tokens_per_sec, exact where the throughput
    counts the loss's targets (translation, causal language models)."""
    train = curves.get("train", {})
    steps_per_sec, tokens_per_sec = (dict(train.get(key, ())) for key in ("steps_per_sec",
                                                                           "tokens_per_sec"))
    seconds = []
    for step, tokens in train.get("target_tokens_per_update", ()):
        if steps_per_sec.get(step):
            seconds.append((step, 1 / steps_per_sec[step]))
        elif tokens_per_sec.get(step):
            seconds.append((step, tokens / tokens_per_sec[step]))
        else:
            raise ValueError(f"{workdir}'s metrics.jsonl: the train line of step {step} has "
                             f"neither steps_per_sec nor tokens_per_sec: plot it with --x=step")
    if not seconds:
        raise ValueError(f"{workdir}'s metrics.jsonl has no train lines with their throughput: "
                         f"plot it with --x=step")
    steps, step_seconds = zip(*seconds, strict=True)
    return np.array([0, *steps]), np.cumsum([0.0, *step_seconds]) / 3600


def plot_curves(workdirs: list[str], out: str, x: str = "step") -> str:
    """Loss, perplexity, learning rate, BLEU, tokens/s and accuracy against step (`x` "step")
    or hours of training (`x` "hours": `training_hours`), every run on the same axes (one
    colour per run, one line style per split); a row of the routers' loads and drops where a
    run has routed layers (docs/moe.md)."""
    if x not in ("step", "hours"):
        raise ValueError(f"--x={x}: give step or hours")
    plt = pyplot()
    runs = [(os.path.basename(os.path.normpath(w)) or w, read_metrics(w)) for w in workdirs]
    clocks = [training_hours(curves, workdir) if x == "hours" else None
              for (_, curves), workdir in zip(runs, workdirs, strict=True)]
    routed = any("expert_load_max" in curves.get("train", {}) for _, curves in runs)
    panels = CURVES + (ROUTER_CURVES if routed else ())
    rows = -(-len(panels) // 3)
    fig, grid = plt.subplots(rows, 3, figsize=(14, 3.75 * rows), layout="constrained")
    axes = grid.flat[:len(panels)]
    for unused in grid.flat[len(panels):]:
        unused.remove()
    styles = {"train": "-", "validation": "--", "test": ":"}
    for (key, label), ax in zip(panels, axes, strict=True):
        for colour, (name, curves) in enumerate(runs):
            for split, by_metric in curves.items():
                points = by_metric.get(key)
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                if x == "hours":
                    steps = np.interp(steps, *clocks[colour])
                ax.plot(steps, values, styles.get(split, "-."), color=f"C{colour}",
                        marker="o" if len(points) < 20 else None, markersize=3,
                        label=f"{name} ({split})")
        ax.set_title(label)
        ax.set_xlabel("step" if x == "step" else "hours of training (train steps only)")
        if key in ("loss", "perplexity"):
            ax.set_yscale("log")
        if ax.has_data():
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center",
                    transform=ax.transAxes)
    return save(fig, out)
