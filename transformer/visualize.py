"""Look inside a trained model: attention maps, training curves, positional encodings.

    python -m transformer.visualize attention --workdir=W --source="..." [--target="..."]
    python -m transformer.visualize curves --workdir W [W2 ...] [--x=hours]
    python -m transformer.visualize positions [--d_model=512] [--length=100]
    python -m transformer.visualize image_attention --workdir=W --image=shirt.png

`attention` runs the model once on the source and the target (by default the run's own beam
search translation), and writes one heatmap per layer and head of encoder self-attention,
decoder self-attention and cross-attention, labelled with SentencePiece pieces, plus an overview
grid per kind, to `<workdir>/plots/attention/`. The weights are the ones the forward pass used:
`MultiHeadAttention` records `attention.attention_weights` when applied with
`mutable=["intermediates"]`. `curves` plots loss, perplexity, learning rate, BLEU and tokens/s
against step (or, `--x=hours`, hours of training) from each run's `metrics.jsonl`;
`positions` the sinusoidal encoding and the dot products between positions.
`image_attention` runs a Vision Transformer (`transformer.classify`) on one image and draws the
class token's attention over the patches on top of it, per layer and head (`heads.png`) and rolled
out over the layers (`rollout.png`, `attention_rollout`), to
`<workdir>/plots/image_attention/<image name>/`. Figures are PNGs (matplotlib, Agg backend: no
display needed).

Shape legend: L layers, N heads, T target length, S source length (an image's tokens), G the
patch grid's side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from transformer.checkpoint import workdir as workdir_lib
from transformer.util import cli

KINDS = ("encoder_self_attention", "decoder_self_attention", "cross_attention")
CURVES = (("loss", "loss (NLL per target token)"), ("perplexity", "perplexity"),
          ("learning_rate", "learning rate"), ("bleu", "sacreBLEU"),
          ("tokens_per_sec", "tokens/s (non-pad target; images or examples for a classifier)"),
          ("accuracy", "accuracy (a classifier)"))
MAX_POSITIONS = 4096  # `positions` draws a [length, length] matrix
MAX_D_MODEL = 8192


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------- attention


@dataclasses.dataclass
class AttentionMaps:
    """Attention weights of one sentence pair, per kind [L, N, queries, keys], and the pieces
    labelling the axes: source (+ EOS), decoder inputs (BOS + target) and outputs (target + EOS).
    """

    weights: dict[str, np.ndarray]
    source_pieces: list[str]
    decoder_input_pieces: list[str]
    target_pieces: list[str]

    def axes(self, kind: str) -> tuple[list[str], list[str]]:
        """(query labels, key labels) of `kind`."""
        return {"encoder_self_attention": (self.source_pieces, self.source_pieces),
                "decoder_self_attention": (self.target_pieces, self.decoder_input_pieces),
                "cross_attention": (self.target_pieces, self.source_pieces)}[kind]


def attention_maps(translator, source: str, target: str | None = None) -> AttentionMaps:
    """Runs `translator`'s model on (source, target) with teacher forcing and returns the
    attention weights of every layer and head. `target` defaults to the model's translation."""
    import jax.numpy as jnp

    from transformer.checkpoint.checkpointer import unstack_layers
    from transformer.data.tokenizer import BOS_ID, EOS_ID
    from transformer.model.transformer import Transformer

    if not source.strip():
        raise ValueError("--source is empty: give a sentence to translate")
    if target is None:
        target = translator.translate([source])[0]
    if not target.strip():
        raise ValueError("the target is empty (the model translated the source to nothing): "
                         "pass --target")
    cfg = dataclasses.replace(translator.model_config, scan_layers=False)
    params = translator.params
    if translator.model_config.scan_layers:
        params = unstack_layers(params)
    source_ids = translator.encode([source])[0]
    target_ids = translator.tokenizer.encode([target])[0][: cfg.max_len - 1] + [EOS_ID]
    _, state = Transformer(cfg).apply(
        {"params": params}, jnp.asarray([source_ids]), jnp.asarray([target_ids]),
        mutable=["intermediates"])
    found = state["intermediates"]

    def stacked(stack: str, num_layers: int, sublayer: str) -> np.ndarray:
        return np.stack([np.asarray(found[stack][f"layers_{i}"][sublayer]
                                    ["attention_weights"][0][0]) for i in range(num_layers)])

    weights = {"encoder_self_attention": stacked("encoder", cfg.num_encoder_layers,
                                                 "self_attention"),
               "decoder_self_attention": stacked("decoder", cfg.num_decoder_layers,
                                                 "self_attention"),
               "cross_attention": stacked("decoder", cfg.num_decoder_layers, "cross_attention")}
    pieces = translator.tokenizer.id_to_piece
    target_pieces = [pieces(i) for i in target_ids]
    return AttentionMaps(weights, [pieces(i) for i in source_ids],
                         [pieces(BOS_ID)] + target_pieces[:-1], target_pieces)


def _heatmap(ax, weights: np.ndarray, queries: list[str], keys: list[str], title: str,
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


def plot_attention(maps: AttentionMaps, out_dir: str) -> list[str]:
    """One PNG per kind, layer and head, and one overview grid per kind; returns the paths."""
    plt = pyplot()
    written = []
    for kind in KINDS:
        weights = maps.weights[kind]
        queries, keys = maps.axes(kind)
        num_layers, num_heads = weights.shape[:2]
        title = kind.replace("_", " ")
        os.makedirs(os.path.join(out_dir, kind), exist_ok=True)
        size = (max(4.0, 0.25 * len(keys) + 2), max(3.5, 0.25 * len(queries) + 1.5))
        for layer in range(num_layers):
            for head in range(num_heads):
                fig, ax = plt.subplots(figsize=size, layout="constrained")
                image = _heatmap(ax, weights[layer, head], queries, keys,
                                 f"{title}, layer {layer + 1}, head {head + 1}")
                fig.colorbar(image, ax=ax, label="attention weight")
                path = os.path.join(out_dir, kind, f"layer{layer + 1}_head{head + 1}.png")
                fig.savefig(path, dpi=100)
                plt.close(fig)
                written.append(path)
        fig, axes = plt.subplots(num_layers, num_heads, squeeze=False, layout="constrained",
                                 figsize=(2.2 * num_heads + 1, 2.2 * num_layers + 0.6))
        for layer in range(num_layers):
            for head in range(num_heads):
                image = _heatmap(axes[layer, head], weights[layer, head], queries, keys,
                                 f"layer {layer + 1}, head {head + 1}", labels=False)
        fig.suptitle(f"{title}: rows are queries, columns keys ({len(queries)} x {len(keys)} "
                     f"pieces)")
        fig.colorbar(image, ax=axes, label="attention weight", shrink=0.8)
        path = os.path.join(out_dir, f"{kind}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


# --------------------------------------------------------------------------- images


def attention_rollout(weights: np.ndarray) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers")
    of one image's weights [L, N, S, S]: each layer's heads averaged, the residual connection
    added as the identity, Â_l = (mean_N A_l + I) / 2 with rows re-normalised to sum to 1, and
    the layers multiplied from the first: R = Â_L ... Â_1, [S, S]. Row t of R: how much of
    token t's final state flows from each input token (each row sums to 1)."""
    s = weights.shape[-1]
    rollout = np.eye(s)
    for layer in np.asarray(weights, np.float64):
        mixed = 0.5 * layer.mean(0) + 0.5 * np.eye(s)
        rollout = (mixed / mixed.sum(-1, keepdims=True)) @ rollout
    return rollout


@dataclasses.dataclass
class ImageAttention:
    """One image through a Vision Transformer: the pixels it saw [H, W, ch] uint8, every
    layer's attention [L, N, S, S], its patch grid's side G and whether token 0 is a class
    token, and its top class."""

    image: np.ndarray
    weights: np.ndarray
    grid: int
    has_class_token: bool
    predicted: str
    probability: float

    def _pooled_row(self, matrix: np.ndarray) -> np.ndarray:
        """[..., S, S] -> [..., G, G]: the class token's row over the patches; without one
        (pooling "gap"), the mean of the patches' rows, what the pooled state draws on."""
        row = matrix[..., 0, 1:] if self.has_class_token else matrix.mean(-2)
        return row.reshape(*row.shape[:-1], self.grid, self.grid)

    def per_head(self) -> np.ndarray:
        """[L, N, G, G]: each layer's and head's attention of the class token over the
        patches."""
        return self._pooled_row(self.weights)

    def rollout(self) -> np.ndarray:
        """[G, G]: the class token's row of `attention_rollout` over the patches."""
        return self._pooled_row(attention_rollout(self.weights))


def image_attention(classifier, image_path: str) -> ImageAttention:
    """Runs `classifier` (`classify.load`) on the image file and keeps every layer's attention
    weights (recorded with `mutable=["intermediates"]`)."""
    import jax

    from transformer import classify
    from transformer.checkpoint.checkpointer import unstack_layers
    from transformer.model.vit import VisionTransformer

    cfg = dataclasses.replace(classifier.model_config, scan_layers=False)
    params = classifier.params
    if classifier.model_config.scan_layers:
        params = unstack_layers(params)
    pixels = classify.read_image(image_path, cfg.image_size, cfg.num_channels)
    logits, state = VisionTransformer(cfg).apply(
        {"params": params}, classifier.normalise(pixels[None]), mutable=["intermediates"])
    found = state["intermediates"]["encoder"]
    weights = np.stack([np.asarray(found[f"layers_{i}"]["self_attention"]
                                   ["attention_weights"][0][0])
                        for i in range(cfg.num_encoder_layers)])
    probabilities = np.asarray(jax.nn.softmax(logits[0]))
    best = int(probabilities.argmax())
    return ImageAttention(pixels, weights, cfg.image_size // cfg.patch_size,
                          cfg.pooling == "cls", classifier.class_names[best],
                          float(probabilities[best]))


def _overlay(ax, image: np.ndarray, grid_map: np.ndarray, title: str):
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


def plot_image_attention(found: ImageAttention, out_dir: str) -> list[str]:
    """`heads.png` (a grid: rows layers, columns heads) and `rollout.png` (the image, and the
    rollout over it); returns their paths."""
    plt = pyplot()
    os.makedirs(out_dir, exist_ok=True)
    token = "class token" if found.has_class_token else "mean patch"
    heads = found.per_head()
    num_layers, num_heads = heads.shape[:2]
    fig, axes = plt.subplots(num_layers, num_heads, squeeze=False, layout="constrained",
                             figsize=(1.8 * num_heads + 0.4, 1.8 * num_layers + 0.6))
    for layer in range(num_layers):
        for head in range(num_heads):
            _overlay(axes[layer, head], found.image, heads[layer, head],
                     f"layer {layer + 1}, head {head + 1}")
    fig.suptitle(f"{token}'s attention over the patches (each map scaled to its maximum); "
                 f"predicted {found.predicted} {100 * found.probability:.1f}%", fontsize=9)
    paths = [os.path.join(out_dir, "heads.png"), os.path.join(out_dir, "rollout.png")]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    fig, (left, right) = plt.subplots(1, 2, figsize=(6.4, 3.6), layout="constrained")
    _overlay(left, found.image, np.zeros((found.grid, found.grid)), "input")
    _overlay(right, found.image, found.rollout(), f"attention rollout over {num_layers} layers")
    fig.suptitle(f"predicted {found.predicted} {100 * found.probability:.1f}%", fontsize=9)
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


# --------------------------------------------------------------------------- curves


def read_metrics(workdir: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """`{split: {metric: [(step, value), ...]}}` from `<workdir>/metrics.jsonl`, the last line
    per (step, split) winning, steps ascending."""
    if not os.path.isdir(workdir):
        raise ValueError(f"--workdir={workdir} is not a directory: give a training run's workdir")
    path = workdir_lib.path(workdir, workdir_lib.METRICS)
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist: is {workdir} a training workdir?")
    last: dict[tuple[int, str], dict] = {}
    with open(path) as f:
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
    colour per run, one line style per split)."""
    if x not in ("step", "hours"):
        raise ValueError(f"--x={x}: give step or hours")
    plt = pyplot()
    runs = [(os.path.basename(os.path.normpath(w)) or w, read_metrics(w)) for w in workdirs]
    clocks = [training_hours(curves, workdir) if x == "hours" else None
              for (_, curves), workdir in zip(runs, workdirs, strict=True)]
    fig, grid = plt.subplots(2, 3, figsize=(14, 7.5), layout="constrained")
    axes = grid.flat[:len(CURVES)]
    for unused in grid.flat[len(CURVES):]:
        unused.remove()
    styles = {"train": "-", "validation": "--", "test": ":"}
    for (key, label), ax in zip(CURVES, axes, strict=True):
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
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------- positions


def plot_positions(d_model: int, length: int, out: str) -> str:
    """The sinusoidal encoding [length, d_model] and its dot products between positions: the
    bands show that the similarity depends on the distance between positions only."""
    from transformer.ops.layers import sinusoidal_position_encoding

    if not (2 <= d_model <= MAX_D_MODEL and d_model % 2 == 0):
        raise ValueError(f"--d_model={d_model} must be even, from 2 to {MAX_D_MODEL}")
    if not 2 <= length <= MAX_POSITIONS:
        raise ValueError(f"--length={length} must be from 2 to {MAX_POSITIONS} positions")
    plt = pyplot()
    table = np.asarray(sinusoidal_position_encoding(length, d_model))
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
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line, exit status 1, like the other
    CLIs (not its usage text and status 2)."""

    def error(self, message: str):
        sys.exit(f"error: {self.prog}: {message} (--help lists the flags)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m transformer.visualize", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    attention = commands.add_parser("attention", help="attention maps of one sentence pair")
    attention.add_argument("--workdir", required=True)
    attention.add_argument("--source", required=True, help="the source sentence")
    attention.add_argument("--target", help="the target sentence (default: the translation)")
    attention.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    attention.add_argument("--out_dir", help="default: <workdir>/plots/attention")
    image = commands.add_parser("image_attention", help="a Vision Transformer's attention "
                                "over an image's patches, per head and rolled out")
    image.add_argument("--workdir", required=True)
    image.add_argument("--image", required=True, help="an image file (PNG, JPEG)")
    image.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    image.add_argument("--out_dir", help="default: <workdir>/plots/image_attention/<image name>")
    curves = commands.add_parser("curves", help="training curves of one or more runs")
    curves.add_argument("--workdir", required=True, nargs="+", help="one or more workdirs")
    curves.add_argument("extra_workdirs", nargs="*", help=argparse.SUPPRESS)
    curves.add_argument("--out", help="default: <first workdir>/plots/curves.png")
    curves.add_argument("--x", default="step", choices=["step", "hours"],
                        help="horizontal axis: update step, or hours of training (the train "
                             "steps' times summed; evaluations and pauses left out)")
    positions = commands.add_parser("positions", help="the sinusoidal positional encoding")
    positions.add_argument("--d_model", type=int, default=512)
    positions.add_argument("--length", type=int, default=100)
    positions.add_argument("--out", help="default: plots/positions_d<d_model>.png")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> list[str]:
    """Writes the figures `args` ask for; returns their paths."""
    if args.command == "attention":
        from transformer.inference.translator import load

        maps = attention_maps(load(args.workdir, step=args.step), args.source, args.target)
        return plot_attention(maps, args.out_dir or workdir_lib.path(
            args.workdir, workdir_lib.PLOTS, "attention"))
    if args.command == "image_attention":
        from transformer import classify

        found = image_attention(classify.load(args.workdir, step=args.step), args.image)
        name = os.path.splitext(os.path.basename(args.image))[0]
        return plot_image_attention(found, args.out_dir or workdir_lib.path(
            args.workdir, workdir_lib.PLOTS, "image_attention", name))
    if args.command == "curves":
        workdirs = args.workdir + args.extra_workdirs
        out = args.out or workdir_lib.path(workdirs[0], workdir_lib.PLOTS, "curves.png")
        return [plot_curves(workdirs, out, x=args.x)]
    out = args.out or os.path.join("plots", f"positions_d{args.d_model}.png")
    return [plot_positions(args.d_model, args.length, out)]


def main(argv: list[str]) -> None:
    import logging

    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's INFO chatter
    cli.quiet_native_logs(["python -m transformer.visualize", *argv])
    with cli.one_line_errors():
        written = run(parse_args(argv))
    overviews = [p for p in written if not os.path.basename(p).startswith("layer")]
    print(f"wrote {len(written)} figure(s)" + (f", per layer and head under "
          f"{os.path.dirname(overviews[0])}/" if len(written) > len(overviews) else "") + ":")
    print("\n".join(f"  {p}" for p in overviews))

if __name__ == "__main__":
    main(sys.argv[1:])
