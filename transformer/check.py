"""Check a run's workdir against the contract (docs/architecture.md, "The workdir").

    python -m transformer.check runs/default [runs/other ...]

Prints one line per problem and a summary line per workdir. Exits 1 if any workdir has a problem.
"""

import os
import sys

from absl import app

from transformer.checkpoint import layout
from transformer.util import cli


def main(argv: list[str]) -> int:
    workdirs = argv[1:]  # absl took the flags (--help)
    if not workdirs:
        print("usage: python -m transformer.check WORKDIR [WORKDIR ...]", file=sys.stderr)
        return 2
    cli.start(argv[:1])
    failed = False
    for workdir in workdirs:
        if not os.path.isdir(workdir):
            print(f"error: {workdir} is not a directory: give a training run's workdir")
            failed = True
            continue
        problems = layout.check(workdir)
        for problem in problems:
            print(f"{workdir}: {problem}")
        print(f"{workdir}: {len(problems)} problem(s)")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    app.run(main)
