"""Check a run's workdir against the contract (docs/architecture.md, "The workdir").

    python -m transformer.check runs/default [runs/other ...]

Prints one line per problem and a summary line per workdir; exits 1 if any workdir has a problem.
"""

import os
import sys

from transformer.checkpoint import layout


def main(argv: list[str]) -> int:
    if not argv or any(arg.startswith("-") for arg in argv):
        print("usage: python -m transformer.check WORKDIR [WORKDIR ...]", file=sys.stderr)
        return 2
    failed = False
    for workdir in argv:
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
    sys.exit(main(sys.argv[1:]))
