"""What the command-line tools share (evaluate, translate, generate; train.py in part): the
flags that name a trained run, quiet logging, and errors as one line.

    from transformer import cli
    cli.define_run_flags(average=True)

    def main(argv):
        cli.start(argv)
        with cli.one_line_errors():
            ...
"""

from __future__ import annotations

import contextlib
import logging
import sys

from absl import app, flags
from absl import logging as absl_logging

FLAGS = flags.FLAGS


def define_run_flags(*, average: bool) -> None:
    """--workdir (required) and --step, and with `average` --average: which parameters of a
    trained run to load."""
    flags.DEFINE_string("workdir", None, "The training run's workdir.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    if average:
        flags.DEFINE_integer("average", None, "Average the last N checkpoints' parameters.")
    flags.mark_flags_as_required(["workdir"])


def start(argv: list[str], *, level: int = logging.WARNING, timestamps: bool = False) -> None:
    """Refuses stray arguments and sets up logging: our lines at `level` on stderr, absl's
    (orbax's INFO chatter) at WARNING."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(message)s" if timestamps else "%(message)s",
                        datefmt="%H:%M:%S")


@contextlib.contextmanager
def one_line_errors():
    """A ValueError or OSError (bad input, a missing or damaged file) ends the program with
    `error: <message>` on stderr and exit status 1, not a traceback."""
    try:
        yield
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
