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
from each run's `metrics.jsonl`, and each run's per-layer gradient, parameter and update norms
by module kind beside it (`curves_layers.png`; `curves_layers_<run>.png` for several runs);
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

import os

from absl import app, flags

from transformer.checkpoint import layout
from transformer.util import cli, plotting

MAX_POSITIONS = 4096  # `positions` draws a [length, length] matrix
MAX_D_MODEL = 8192

# Each command's flags, the required ones first: a flag of another command is refused.
COMMANDS = {"attention": (("workdir", "source"), ("target", "step", "out_dir")),
            "image_attention": (("workdir", "image"), ("step", "out_dir")),
            "curves": (("workdir",), ("out", "x")),
            "positions": ((), ("d_model", "length", "out"))}
flags.DEFINE_string("workdir", None, "attention, image_attention, curves: the training run's "
                    "workdir (curves: one or more, `--workdir W W2 ...`).")
flags.DEFINE_string("source", None, "attention: the source sentence.")
flags.DEFINE_string("target", None, "attention: the target sentence (default: the translation).")
flags.DEFINE_string("image", None, "image_attention: an image file (PNG, JPEG).")
flags.DEFINE_integer("step", None, "attention, image_attention: checkpoint step (default: the "
                     "latest).", lower_bound=0)
flags.DEFINE_string("out_dir", None, "attention: default <workdir>/plots/attention; "
                    "image_attention: default <workdir>/plots/image_attention/<image name>.")
flags.DEFINE_string("out", None, "curves: default <first workdir>/plots/curves.png; positions: "
                    "default plots/positions_d<d_model>.png.")
flags.DEFINE_enum("x", "step", ["step", "hours"], "curves: horizontal axis: update step, or "
                  "hours of training (the train steps' times summed; evaluations and pauses "
                  "left out).")
flags.DEFINE_integer("d_model", 512, "positions: the encoding's width.")
flags.DEFINE_integer("length", 100, "positions: how many positions.")
FLAGS = flags.FLAGS


def check_command_line(argv: list[str]) -> tuple[str, list[str]]:
    """The command and the extra workdirs `curves` takes after `--workdir W` (`argv`: what absl
    left, the program first). A bad command line ends the program as one line."""
    if len(argv) < 2 or argv[1] not in COMMANDS:
        cli.usage_error((f"{argv[1]!r} is not a command; " if len(argv) > 1 else "") +
                        f"give a command: {', '.join(COMMANDS)}")
    command = argv[1]
    rest = argv[2:]
    required, optional = COMMANDS[command]
    if command != "curves" and rest:
        cli.usage_error(f"unexpected arguments: {' '.join(rest)}")
    others = sorted({name for names in COMMANDS.values() for group in names for name in group}
                    - {*required, *optional})
    if wrong := [f"--{name}" for name in others if FLAGS[name].present]:
        cli.usage_error(f"{command} takes no {', '.join(wrong)}; its flags: "
                        f"{', '.join(f'--{name}' for name in (*required, *optional))}")
    if missing := [f"--{name}" for name in required if FLAGS[name].value is None]:
        cli.usage_error(f"{command} needs {', '.join(missing)}")
    return command, rest


def run(command: str, extra_workdirs: list[str]) -> list[str]:
    """Writes the figures `command` and the flags ask for. Returns their paths."""
    if command == "attention":
        from transformer.inference.attention_maps import attention_maps
        from transformer.inference.translator import load

        maps = attention_maps(load(FLAGS.workdir, step=FLAGS.step), FLAGS.source, FLAGS.target)
        return plotting.plot_attention(maps, FLAGS.out_dir or layout.path(
            FLAGS.workdir, layout.PLOTS, "attention"))
    if command == "image_attention":
        from transformer.inference.attention_maps import image_attention
        from transformer.inference.classifier import load

        found = image_attention(load(FLAGS.workdir, step=FLAGS.step), FLAGS.image)
        name = os.path.splitext(os.path.basename(FLAGS.image))[0]
        return plotting.plot_image_attention(found, FLAGS.out_dir or layout.path(
            FLAGS.workdir, layout.PLOTS, "image_attention", name))
    if command == "curves":
        from transformer.training import curves

        workdirs = [FLAGS.workdir, *extra_workdirs]
        out = FLAGS.out or layout.path(workdirs[0], layout.PLOTS, "curves.png")
        runs = curves.collect(workdirs, FLAGS.x)
        written = [plotting.plot_curves(runs, out, x=FLAGS.x)]
        stem, extension = os.path.splitext(out)
        for name, run_curves, clock in runs:  # per-layer health, where logged
            if layers := curves.layer_curves(run_curves):
                suffix = f"_{name}" if len(runs) > 1 else ""
                written.append(plotting.plot_layer_health(
                    name, layers, f"{stem}_layers{suffix}{extension or '.png'}", x=FLAGS.x,
                    clock=clock))
        return written
    return [plot_positions(FLAGS.d_model, FLAGS.length, FLAGS.out)]


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
    command, extra_workdirs = check_command_line(argv)
    cli.start(argv[:1])
    with cli.one_line_errors():
        written = run(command, extra_workdirs)
    overviews = [p for p in written if not os.path.basename(p).startswith("layer")]
    print(f"wrote {len(written)} figure(s)" + (f", per layer and head under "
          f"{os.path.dirname(overviews[0])}/" if len(written) > len(overviews) else "") + ":")
    print("\n".join(f"  {p}" for p in overviews))


if __name__ == "__main__":
    app.run(main)
