"""Translate text with a trained run: one sentence a line, in order.

    python -m transformer.translate --workdir=runs/default [--average=5 | --step=N] \\
        [--input=file] [--output=file] [--beam_size=4] [--alpha=0.6] [--quantize=int8]

Reads stdin (or --input) and writes stdout (or --output) as it goes: 8 batches of lines at a
time, each written and flushed before the next are read (`text_input.stream`: bounded memory,
and an interrupted run leaves whole lines). Empty lines stay empty. Lines longer than the model
allows are truncated with a warning. Input that is not UTF-8 is an error naming the line.
"""

from absl import app, flags

from transformer.util import cli

cli.define_run_flags(average=True)
flags.DEFINE_string("input", None, "Input file (default: stdin).")
flags.DEFINE_string("output", None, "Output file (default: stdout).")
flags.DEFINE_integer("beam_size", None, "Beam size (default: the config's; 1: greedy).",
                     lower_bound=1)
flags.DEFINE_float("alpha", None, "Length penalty alpha (default: the config's).",
                   lower_bound=0.0)
flags.DEFINE_string("quantize", "none", "int8: int8 attention and feed-forward kernels "
                    "and KV cache (none: the run's own precision).")
flags.DEFINE_integer("batch_size", 32, "Sentences decoded together.", lower_bound=1)
FLAGS = flags.FLAGS
READ_AHEAD_BATCHES = 8  # lines read at a time, sorted by length into batches, then written


def main(argv):
    cli.start(argv)
    from transformer.inference.quantize import check_quantize

    try:
        check_quantize(FLAGS.quantize)
    except ValueError as error:
        cli.usage_error(str(error))
    from transformer.inference.translator import load
    from transformer.util import text_input

    translator = None

    def translate(lines: list[str], first: int) -> list[str]:
        nonlocal translator
        if translator is None:
            translator = load(FLAGS.workdir, step=FLAGS.step, average=FLAGS.average,
                              quantize=FLAGS.quantize)
        return translator.translate(lines, beam_size=FLAGS.beam_size, alpha=FLAGS.alpha,
                                    batch_size=FLAGS.batch_size, show_progress=False)

    text_input.stream(translate, chunk_lines=READ_AHEAD_BATCHES * FLAGS.batch_size,
                      input_path=FLAGS.input, output_path=FLAGS.output, desc="translated",
                      unit="sentence")


if __name__ == "__main__":
    app.run(main)
