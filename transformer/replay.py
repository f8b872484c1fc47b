"""Replay one training step of a run and list its batch: "was it the data or the machine?".

    python -m transformer.replay --workdir=runs/default --step=N

Restores the newest checkpoint before step N, runs the steps after it up to N with the run's
batches and dropout keys (`transformer.training.replay`), and prints step N's logged loss (from
`<workdir>/metrics.jsonl`) beside the replayed one, then the examples of batch N: file and row
for a source of files, else the index in the training split. On the mesh the run trained on the
two are equal bit for bit. Where step N has no logged loss (a kill before its line was written)
it prints the replayed one and compares the replayed steps before it that were logged. Exit
status 0 when every logged loss it replayed is equal, 1 when one differs (or on bad input).
"""

import logging
import sys

from absl import app, flags

from transformer.util import cli

flags.DEFINE_string("workdir", None, "The training run's workdir.")
flags.DEFINE_integer("step", None, "The step to replay (1 = the first update).")
flags.DEFINE_integer("max_examples", 64, "List at most this many examples of the batch (0: all).",
                     lower_bound=0)
flags.mark_flags_as_required(["workdir", "step"])
FLAGS = flags.FLAGS


def report(result) -> list[str]:
    """The lines the command prints for a `Replayed`."""
    n = result.step
    lines = []
    if result.run_mesh is not None and result.run_mesh != result.mesh:
        lines.append(f"note: replayed on mesh {result.mesh}, the run trained on "
                     f"{result.run_mesh}: expect equality only to the reduction order")
    if n in result.logged:
        verdict = "equal bit for bit" if result.equal(n) else "DIFFERENT"
        lines.append(f"step {n}: logged loss {result.logged[n]!r}, replayed loss "
                     f"{result.loss!r} (from checkpoint {result.restored}): {verdict}")
    else:
        compared = [s for s in result.logged if s != n]
        lines.append(f"step {n}: no logged loss in metrics.jsonl (its line was lost to a kill); "
                     f"replayed loss {result.loss!r} (from checkpoint {result.restored})")
        if compared:
            same = all(result.equal(s) for s in compared)
            lines.append(f"steps {compared[0]}..{compared[-1]} replayed before it: "
                         + ("logged losses equal bit for bit" if same else
                            "DIFFERENT from the logged losses"))
    differ = [s for s in result.logged if s != n and not result.equal(s)]
    if differ and n in result.logged:
        lines.append(f"steps before it that differ: {', '.join(map(str, differ))}")
    examples = result.examples
    shown = examples[:FLAGS.max_examples] if FLAGS.max_examples else examples
    lines.append(f"batch {result.batch_index} of step {n}: {len(examples)} examples")
    lines += [f"  {example}" for example in shown]
    if len(shown) < len(examples):
        lines.append(f"  ... {len(examples) - len(shown)} more (--max_examples=0 lists all)")
    return lines


def main(argv):
    cli.start(argv, level=logging.WARNING)
    from transformer.training import replay

    with cli.one_line_errors():
        replay.check_step(FLAGS.workdir, FLAGS.step)  # bad input: before any compile
        result = replay.replay(FLAGS.workdir, FLAGS.step)
    print("\n".join(report(result)))
    if any(result.equal(s) is False for s in result.logged):
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
