"""The table of the results page from the records beside this file: per local save (the first,
which compiles the checksums, and the final persistent save left out) the loop's time in the
metrics sync and the save (the wait for the previous local save, checksums, orbax's blocking
part), and that cost as a share of the steps between two saves (a step: goodput's `steps`
seconds over the steps)."""

import json
import pathlib
import statistics
import sys

here = pathlib.Path(__file__).parent
print("| run | local saves | sync ms | wait ms | orbax ms | cost per save ms | step ms "
      "| share of the interval |")
print("|---|---|---|---|---|---|---|---|")
for name in sys.argv[1:]:
    d = json.loads((here / f"{name}.json").read_text())
    calls, every, steps = d["calls_s"], d["every"], d["steps"]
    local = slice(1, steps // every - 1)  # saves 2 .. the last local one
    sync = calls["metrics sync"][local]
    save = calls["save (all of it)"][local]
    wait = calls["wait for the previous save"][1::2][local]  # the local tier's own wait
    orbax = calls["orbax save (blocking part)"][local]
    step = d["goodput"]["goodput_seconds/steps"] / steps
    cost = statistics.mean(a + b for a, b in zip(sync, save, strict=True))
    print(f"| {name} (every {every}) | {len(save)} | {1000 * statistics.mean(sync):.0f} | "
          f"{1000 * statistics.mean(wait):.0f} | {1000 * statistics.mean(orbax):.0f} | "
          f"{1000 * cost:.0f} | {1000 * step:.1f} | {100 * cost / (every * step):.1f}% |")
