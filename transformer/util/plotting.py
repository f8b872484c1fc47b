"""Every figure the commands draw, with matplotlib on the Agg backend (no display needed):
training curves, confusion matrices, attention maps and the sinusoidal encoding, and saving a
figure to a local or remote path. The libraries compute what is drawn and never import this
module: `train.py`, `evaluate` and `visualize` call it."""

from __future__ import annotations

import io
import json
import os

import numpy as np
from etils import epath

from transformer.util import atomic

CURVES = (("loss", "loss (NLL per target token)"), ("perplexity", "perplexity"),
          ("learning_rate", "learning rate"), ("bleu", "sacreBLEU"),
          ("tokens_per_sec", "tokens/s (non-pad target; images or examples for a classifier)"),
          ("accuracy", "accuracy (a classifier)"))
ROUTER_CURVES = (("expert_load_max", "most-loaded expert's share of assignments"),
                 ("expert_load_min", "least-loaded expert's share of assignments"),
                 ("moe_dropped", "assignments dropped over capacity"))  # routed runs only


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str, dpi: int = 100) -> str:
    """Writes `fig` to `path` at `dpi` (its format from the extension; PNG without one), local
    or remote (gs://: rendered in memory, then written whole through `atomic`), and closes it."""
    image = io.BytesIO()
    fig.savefig(image, format=os.path.splitext(path)[1][1:] or None, dpi=dpi)
    pyplot().close(fig)
    epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic.write_atomically(path, image.getvalue())
    return path


def heatmap(ax, weights: np.ndarray, queries: list[str], keys: list[str], title: str,
             labels: bool = True):
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_title(title, fontsize=9)
    if labels:
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
        ax.set_yticks(range(len(queries)), queries, fontsize=7)
        ax.set_xlabel("attends to (keys)")
        ax.set_ylabel("query")
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    return image


def overlay(ax, image: np.ndarray, grid_map: np.ndarray, title: str):
    """The image in grey with `grid_map` [G, G] over it, one block per patch, scaled to its
    maximum."""
    h, w = image.shape[:2]
    ax.imshow(image if image.shape[-1] == 3 else image[..., 0], cmap="gray",
              extent=(0, w, h, 0))
    ax.imshow(grid_map / max(float(grid_map.max()), 1e-12), cmap="inferno", alpha=0.55,
              vmin=0.0, vmax=1.0, extent=(0, w, h, 0), interpolation="nearest")
    ax.set_title(title, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_confusion_matrix(record_path: str, path: str) -> str:
    """A heatmap of the confusion matrix that `training/evaluation.py` keeps at `record_path`
    (rows: true class, columns: predicted), coloured by the fraction of each true class,
    with the counts written in up to 20 classes. A PNG at `path`, local or remote."""
    record = json.loads(epath.Path(record_path).read_text())
    confusion = np.asarray(record["counts"], np.int64)
    class_names = record["class_names"]
    title = record["title"]
    plt = pyplot()
    classes = len(class_names)
    fractions = confusion / np.maximum(confusion.sum(1, keepdims=True), 1)
    size = max(5.0, 0.5 * classes + 2.0) if classes <= 40 else 12.0
    fig, ax = plt.subplots(figsize=(size, size))
    image = ax.imshow(fractions, cmap="Blues", vmin=0.0, vmax=1.0)
    if classes <= 40:
        ax.set_xticks(range(classes), class_names, rotation=90)
        ax.set_yticks(range(classes), class_names)
    if classes <= 20:
        for i in range(classes):
            for j in range(classes):
                ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if fractions[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.046, label="fraction of the true class")
    fig.tight_layout()
    return save(fig, path)


def plot_positions(table: np.ndarray, out: str) -> str:
    """The sinusoidal encoding `table` [length, d_model] and its dot products between
    positions: the bands show that the similarity depends on the distance between positions
    only."""
    plt = pyplot()
    table = np.asarray(table)
    d_model = table.shape[1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), layout="constrained")
    image = left.imshow(table, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    left.set_title(f"sinusoidal encoding, d_model {d_model}")
    left.set_xlabel("dimension (sin at even, cos at odd)")
    left.set_ylabel("position")
    fig.colorbar(image, ax=left)
    image = right.imshow(table @ table.T, cmap="viridis", aspect="auto")
    right.set_title("PE(pos) . PE(pos'): a function of pos - pos' only")
    right.set_xlabel("position pos'")
    right.set_ylabel("position pos")
    fig.colorbar(image, ax=right)
    return save(fig, out)


def plot_attention(maps, out_dir: str) -> list[str]:
    """One PNG per kind, layer and head, and one overview grid per kind, in `out_dir` (local or
    gs://). `maps` is an `inference/attention_maps.py` AttentionMaps. Returns the paths."""
    plt = pyplot()
    written = []
    for kind in maps.weights:
        weights = maps.weights[kind]
        queries, keys = maps.axes(kind)
        num_layers, num_heads = weights.shape[:2]
        title = kind.replace("_", " ")
        size = (max(4.0, 0.25 * len(keys) + 2), max(3.5, 0.25 * len(queries) + 1.5))
        for layer in range(num_layers):
            for head in range(num_heads):
                fig, ax = plt.subplots(figsize=size, layout="constrained")
                image = heatmap(ax, weights[layer, head], queries, keys,
                                 f"{title}, layer {layer + 1}, head {head + 1}")
                fig.colorbar(image, ax=ax, label="attention weight")
                written.append(save(fig, os.path.join(
                    out_dir, kind, f"layer{layer + 1}_head{head + 1}.png")))
        fig, axes = plt.subplots(num_layers, num_heads, squeeze=False, layout="constrained",
                                 figsize=(2.2 * num_heads + 1, 2.2 * num_layers + 0.6))
        for layer in range(num_layers):
            for head in range(num_heads):
                image = heatmap(axes[layer, head], weights[layer, head], queries, keys,
                                 f"layer {layer + 1}, head {head + 1}", labels=False)
        fig.suptitle(f"{title}: rows are queries, columns keys ({len(queries)} x {len(keys)} "
                     f"pieces)")
        fig.colorbar(image, ax=axes, label="attention weight", shrink=0.8)
        written.append(save(fig, os.path.join(out_dir, f"{kind}.png")))
    return written


def plot_image_attention(found, out_dir: str) -> list[str]:
    """`heads.png` (a grid: rows layers, columns heads) and `rollout.png` (the image, and the
    rollout over it) of an `inference/attention_maps.py` ImageAttention. Returns their paths."""
    plt = pyplot()
    token = "class token" if found.has_class_token else "mean patch"
    heads = found.per_head()
    num_layers, num_heads = heads.shape[:2]
    fig, axes = plt.subplots(num_layers, num_heads, squeeze=False, layout="constrained",
                             figsize=(1.8 * num_heads + 0.4, 1.8 * num_layers + 0.6))
    for layer in range(num_layers):
        for head in range(num_heads):
            overlay(axes[layer, head], found.image, heads[layer, head],
                     f"layer {layer + 1}, head {head + 1}")
    fig.suptitle(f"{token}'s attention over the patches (each map scaled to its maximum); "
                 f"predicted {found.predicted} {100 * found.probability:.1f}%", fontsize=9)
    paths = [save(fig, os.path.join(out_dir, "heads.png"))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(6.4, 3.6), layout="constrained")
    overlay(left, found.image, np.zeros((found.grid, found.grid)), "input")
    overlay(right, found.image, found.rollout(), f"attention rollout over {num_layers} layers")
    fig.suptitle(f"predicted {found.predicted} {100 * found.probability:.1f}%", fontsize=9)
    return paths + [save(fig, os.path.join(out_dir, "rollout.png"))]


def plot_curves(runs, out: str, x: str = "step") -> str:
    """Loss, perplexity, learning rate, BLEU, tokens/s and accuracy against step (`x` "step")
    or hours of training (`x` "hours"), every run on the same axes: one colour per run, one
    line style per split. A row of the routers' loads and drops is added where a run has
    routed layers (docs/moe.md). `runs` comes from `training/curves.py`'s `collect`."""
    plt = pyplot()
    routed = any("expert_load_max" in curves.get("train", {}) for _, curves, _ in runs)
    panels = CURVES + (ROUTER_CURVES if routed else ())
    rows = -(-len(panels) // 3)
    fig, grid = plt.subplots(rows, 3, figsize=(14, 3.75 * rows), layout="constrained")
    axes = grid.flat[:len(panels)]
    for unused in grid.flat[len(panels):]:
        unused.remove()
    styles = {"train": "-", "validation": "--", "test": ":"}
    for (key, label), ax in zip(panels, axes, strict=True):
        for colour, (name, curves, clock) in enumerate(runs):
            for split, by_metric in curves.items():
                points = by_metric.get(key)
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                if x == "hours":
                    steps = np.interp(steps, *clock)
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


LAYER_QUANTITIES = (("grad_norm", "gradient norm"), ("param_norm", "parameter norm"),
                    ("update_norm", "update norm"),
                    ("attention_logit_max", "eval attention logit max"),
                    ("activation_rms", "eval activation RMS"))
EVAL_LAYER_QUANTITIES = ("attention_logit_max", "activation_rms")  # drawn where recorded only


def plot_layer_health(name: str, layers: dict, out: str, x: str = "step",
                      clock: tuple | None = None) -> str:
    """One run's per-layer health: a row per quantity (gradient, parameter, update norm), a
    column per module kind, a line per layer coloured from the first layer (dark) to the last
    (light), the encoder's solid and the decoder's dashed; log scale. The eval rows (attention
    logit maxima, linear scale; activation RMS) have panels only where recorded. `layers` from
    `training/curves.py`'s `layer_curves`, `clock` (for `x` "hours") from `collect`."""
    plt = pyplot()
    kinds = list(dict.fromkeys(kind for by_kind in layers.values() for kind in by_kind))
    rows = [(key, label) for key, label in LAYER_QUANTITIES if key in layers]
    fig, grid = plt.subplots(len(rows), len(kinds), squeeze=False, layout="constrained",
                             figsize=(3.6 * len(kinds), 2.8 * len(rows)))
    colours = plt.get_cmap("viridis")
    for (key, label), axes in zip(rows, grid, strict=True):
        for kind, ax in zip(kinds, axes, strict=True):
            lines = layers[key].get(kind, {})
            if key in EVAL_LAYER_QUANTITIES and not lines:
                ax.remove()
                continue
            for index, (where, points) in enumerate(lines.items()):
                steps, values = zip(*points, strict=True)
                if x == "hours":
                    steps = np.interp(steps, *clock)
                ax.plot(steps, values, "--" if where.startswith("decoder") else "-",
                        color=colours(index / max(len(lines) - 1, 1)), label=where,
                        marker="o" if len(points) < 20 else None, markersize=2)
            ax.set_title(f"{label}: {kind}", fontsize=9)
            ax.set_xlabel("step" if x == "step" else "hours of training (train steps only)")
            if ax.has_data():
                # Log scale where some value is positive: a quantity that stayed zero (say
                # the updates of a frozen group) is drawn on a linear axis.
                positive = any(value > 0 for points in lines.values() for _, value in points)
                logarithmic = key != "attention_logit_max" and positive
                ax.set_yscale("log" if logarithmic else "linear")
                ax.legend(fontsize=6, ncol=2 if len(lines) > 8 else 1)
            else:
                ax.text(0.5, 0.5, "none", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{name}: per-layer health", fontsize=10)
    return save(fig, out)
