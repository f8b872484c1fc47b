"""A run's metrics.jsonl read back: the curves per split and metric, the hours of training
behind each step, and the per-layer health curves (`visualize curves` draws them with
`util/plotting.py`)."""

from __future__ import annotations

import json
import os

import numpy as np
from etils import epath

from transformer.checkpoint import layout
from transformer.training import health


def read_metrics(workdir: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """`{split: {metric: [(step, value), ...]}}` from `<workdir>/metrics.jsonl`, the last line
    per (step, split) winning, steps ascending; `workdir` local or remote (gs://)."""
    if not epath.Path(workdir).is_dir():
        raise ValueError(f"--workdir={workdir} is not a directory: give a training run's workdir")
    path = layout.path(workdir, layout.METRICS)
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
    evaluations are left out. A step's time is 1 / steps_per_sec. Lines written before that
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


def collect(workdirs: list[str], x: str = "step") -> list[tuple[str, dict, tuple | None]]:
    """(name, curves, clock) of each run for `plotting.plot_curves`: its metrics.jsonl read
    back and, for `x` "hours", the hours of training behind each step (`training_hours`)."""
    if x not in ("step", "hours"):
        raise ValueError(f"--x={x}: give step or hours")
    runs = []
    for workdir in workdirs:
        curves = read_metrics(workdir)
        clock = training_hours(curves, workdir) if x == "hours" else None
        runs.append((os.path.basename(os.path.normpath(workdir)) or workdir, curves, clock))
    return runs


def layer_curves(curves: dict) -> dict[str, dict[str, dict[str, list[tuple[int, float]]]]]:
    """A run's per-layer health (`read_metrics`' train lines: `grad_norm/decoder/layers_3/
    attention` and the like, training/health.py) as `{quantity: {kind: {where: points}}}`,
    `where` the layer (`decoder/layers_3`), the stack (`decoder`) or "model", in model order.
    The eval lines' `attention_logit_max/decoder/layers_3/self_attention` (kind "attention",
    where `decoder/layers_3 self`) and `activation_rms/decoder/layers_3` (kind "residual")
    are added from the first split other than train that has them. Empty for a run that
    logged none."""
    train = curves.get("train", {})
    keys = [key for key in train if key.split("/", 1)[0] in health.QUANTITIES and "/" in key]
    groups = sorted({key.split("/", 1)[1] for key in keys}, key=health.group_order)
    found: dict[str, dict[str, dict[str, list[tuple[int, float]]]]] = {}
    for quantity in health.QUANTITIES:
        for group in groups:
            points = train.get(f"{quantity}/{group}")
            if points:
                where, _, kind = group.rpartition("/")
                found.setdefault(quantity, {}).setdefault(kind, {})[where or "model"] = points
    return found | _eval_layer_curves(curves)


def _eval_layer_curves(curves: dict) -> dict[str, dict[str, dict[str, list]]]:
    """`layer_curves`' eval quantities (`health.EVAL_QUANTITIES`) of one eval split."""
    for split, by_metric in curves.items():
        keys = [key for key in by_metric if key.split("/", 1)[0] in health.EVAL_QUANTITIES]
        if split == "train" or not keys:
            continue
        found: dict[str, dict[str, dict[str, list]]] = {}
        for key in sorted(keys, key=lambda k: health.group_order(k.split("/", 1)[1])):
            quantity, layer = key.split("/", 1)
            if quantity == health.LOGIT_MAX:  # {stack}/layers_i/{self,cross}_attention
                layer, _, kind = layer.rpartition("/")
                layer = f"{layer} {kind.removesuffix('_attention')}"
            column = "attention" if quantity == health.LOGIT_MAX else "residual"
            found.setdefault(quantity, {}).setdefault(column, {})[layer] = by_metric[key]
        return found
    return {}
