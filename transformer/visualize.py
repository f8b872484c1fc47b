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
(and a routed run's expert loads and drops) against step (or, `--x=hours`, hours of training)
from each run's `metrics.jsonl`;
`positions` the sinusoidal encoding and the dot products between positions.
`image_attention` runs a Vision Transformer (`inference.classifier`) on one image and draws the
class token's attention over the patches on top of it, per layer and head (`heads.png`) and rolled
out over the layers (`rollout.png`, `attention_rollout`), to
`<workdir>/plots/image_attention/<image name>/`. Figures are PNGs (matplotlib, Agg backend: no
display needed).

Shape legend: L layers, N heads, T target length, S source length (an image's tokens), G the
patch grid's side.
"""

from __future__ import annotations

import argparse
import os
import sys

from transformer.checkpoint import layout
from transformer.util import cli, plotting

# --------------------------------------------------------------------------- images

MAX_POSITIONS = 4096  # `positions` draws a [length, length] matrix
MAX_D_MODEL = 8192








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
        from transformer.inference.attention_maps import attention_maps
        from transformer.inference.translator import load

        maps = attention_maps(load(args.workdir, step=args.step), args.source, args.target)
        return plotting.plot_attention(maps, args.out_dir or layout.path(
            args.workdir, layout.PLOTS, "attention"))
    if args.command == "image_attention":
        from transformer.inference.attention_maps import image_attention
        from transformer.inference.classifier import load

        found = image_attention(load(args.workdir, step=args.step), args.image)
        name = os.path.splitext(os.path.basename(args.image))[0]
        return plotting.plot_image_attention(found, args.out_dir or layout.path(
            args.workdir, layout.PLOTS, "image_attention", name))
    if args.command == "curves":
        from transformer.training import curves

        workdirs = args.workdir + args.extra_workdirs
        out = args.out or layout.path(workdirs[0], layout.PLOTS, "curves.png")
        return [plotting.plot_curves(curves.collect(workdirs, args.x), out, x=args.x)]
    return [plot_positions(args.d_model, args.length, args.out)]


def plot_positions(d_model: int, length: int, out: str | None) -> str:
    """The sinusoidal encoding of `length` positions and `d_model` dimensions, drawn to `out`
    (default plots/positions_d<d_model>.png)."""
    from transformer.ops.layers import sinusoidal_position_encoding

    if not (2 <= d_model <= MAX_D_MODEL and d_model % 2 == 0):
        raise ValueError(f"--d_model={d_model} must be even, from 2 to {MAX_D_MODEL}")
    if not 2 <= length <= MAX_POSITIONS:
        raise ValueError(f"--length={length} must be from 2 to {MAX_POSITIONS} positions")
    table = sinusoidal_position_encoding(length, d_model)
    return plotting.plot_positions(table, out or os.path.join("plots", f"positions_d{d_model}.png"))


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
