"""Score a trained run on a split: perplexity and both BLEUs, like the paper's Table 2 (an
image classifier: loss, accuracy, top-5 accuracy and a confusion matrix), with
`transformer.training.evaluation`.

    python -m transformer.evaluate --workdir=runs/default --split=test [--average=5 | --step=N]
        [--beam_size=4 --alpha=0.6]

Prints the figures, appends them to `<workdir>/metrics.jsonl` (split "validation" or "test"),
and writes the sources, references and translations it scored to `<workdir>/eval/`. For an
image classifier it keeps the confusion matrix there and draws it in `<workdir>/plots/`.
"""

import logging

from absl import app, flags

from transformer.util import cli

cli.define_run_flags(average=True)
flags.DEFINE_enum("split", "test", ["validation", "test"], "The split to score.")
flags.DEFINE_integer("num_sentences", None, "Score only the first N sentences (default: all).",
                     lower_bound=1)
flags.DEFINE_integer("beam_size", None, "Beam size (default: the config's; 1: greedy).",
                     lower_bound=1)
flags.DEFINE_float("alpha", None, "Length penalty of the beam search (default: the config's).",
                   lower_bound=0.0)
FLAGS = flags.FLAGS


def main(argv):
    cli.start(argv, level=logging.INFO, timestamps=True)
    from transformer.training.evaluation import confusion_files, evaluate_run, scores_line
    from transformer.util import plotting

    with cli.one_line_errors():
        figures = evaluate_run(FLAGS.workdir, FLAGS.split, step=FLAGS.step, average=FLAGS.average,
                               num_sentences=FLAGS.num_sentences,
                               beam_size=FLAGS.beam_size, alpha=FLAGS.alpha)
    if "accuracy" in figures:
        plotting.plot_confusion_matrix(*confusion_files(FLAGS.workdir, FLAGS.split))
    print(scores_line(FLAGS.split, figures))


if __name__ == "__main__":
    app.run(main)
