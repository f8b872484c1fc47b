"""Continue prompts with a trained decoder-only language model, one prompt a line.

    python -m transformer.generate --workdir=runs/lm_default --prompt="Click the"
    python -m transformer.generate --workdir=runs/lm_default < prompts.txt \\
        [--max_new_tokens=40] [--temperature=0.8] [--top_k=0] [--top_p=0.95] [--seed=0] \\
        [--quantize=int8]

`--prompt` (repeatable) or stdin (or `--input`). Writes each prompt with its continuation on
one line to stdout (or `--output`), streamed as translate does (`text_input.stream`).
`--temperature=0` is greedy. Unset options come from the run's config (`generate.*`). The same
seed gives the same continuations (batched, streamed or not: prompt i always draws with key i).
"""

from absl import app, flags

from transformer.util import cli

cli.define_run_flags(average=False)
flags.DEFINE_multi_string("prompt", None, "A prompt (repeatable); default: stdin or --input.")
flags.DEFINE_string("input", None, "Prompts file, one a line (default: stdin).")
flags.DEFINE_string("output", None, "Output file (default: stdout).")
flags.DEFINE_integer("max_new_tokens", None, "Tokens to add at most (default: the config's).",
                     lower_bound=1)
flags.DEFINE_float("temperature", None, "Softmax temperature; 0 is greedy.", lower_bound=0.0)
flags.DEFINE_integer("top_k", None, "Sample from the k most likely tokens (0: all).",
                     lower_bound=0)
flags.DEFINE_float("top_p", None, "Sample from the smallest set of this probability (1: all).",
                   lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_integer("seed", 0, "Sampling seed.", lower_bound=0)
flags.DEFINE_string("quantize", "none", "int8: int8 attention and feed-forward kernels "
                    "and KV cache (none: the run's own precision).")
flags.DEFINE_integer("batch_size", 32, "Prompts generated together.", lower_bound=1)
FLAGS = flags.FLAGS
READ_AHEAD_BATCHES = 8  # prompts read at a time, bucketed into batches, then written


def main(argv):
    cli.start(argv)
    from transformer.inference.quantize import check_quantize

    try:
        check_quantize(FLAGS.quantize)
    except ValueError as error:
        cli.usage_error(str(error))
    from transformer.inference.generator import load_generator
    from transformer.util import text_input

    generator = None

    def continue_prompts(prompts: list[str], first: int) -> list[str]:
        nonlocal generator
        if not prompts:
            raise ValueError("no prompt: pass --prompt=... or one prompt a line on stdin")
        if generator is None:
            generator = load_generator(FLAGS.workdir, step=FLAGS.step, quantize=FLAGS.quantize)
        return generator.generate(prompts, max_new_tokens=FLAGS.max_new_tokens,
                                  temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                                  top_p=FLAGS.top_p, seed=FLAGS.seed,
                                  batch_size=FLAGS.batch_size, first_index=first,
                                  show_progress=False)

    text_input.stream(continue_prompts, chunk_lines=READ_AHEAD_BATCHES * FLAGS.batch_size,
                      input_path=FLAGS.input, output_path=FLAGS.output,
                      lines=FLAGS.prompt or None, desc="generated", unit="prompt")


if __name__ == "__main__":
    app.run(main)
