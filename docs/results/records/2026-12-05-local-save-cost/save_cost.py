"""Where a local save's time goes: the tiny config on one CPU device, a local save every
`--every` steps (0: no local tier), each blocking piece of every save timed by wrapping it.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 \
        python save_cost.py --steps=200 --every=10 --out=on.json

Writes the per-call seconds of each piece, the goodput figures of the last train line and the
loop's time per step (1 / steps_per_sec of every train line) to `--out`.
"""

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import runpy
import shutil
import statistics
import tempfile
import time

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--every", type=int, default=10)
parser.add_argument("--local", default="/dev/shm")
parser.add_argument("--out", required=True)
parser.add_argument("--cprofile", action="store_true", help="profile the saves (slows them)")
args = parser.parse_args()

import orbax.checkpoint as ocp  # noqa: E402
from ml_collections import ConfigDict  # noqa: E402

from transformer.checkpoint import checkpointer, tiers  # noqa: E402
from transformer.training import loop, metrics  # noqa: E402

calls: dict[str, list[float]] = {}
profiler = cProfile.Profile()  # the saves and syncs only (entered at the outermost)
depth = [0]


def timed(owner, name, label):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*a, **k):
        start = time.perf_counter()
        depth[0] += 1
        if depth[0] == 1 and args.cprofile:
            profiler.enable()
        try:
            return original(*a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0 and args.cprofile:
                profiler.disable()
            calls.setdefault(label, []).append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


timed(metrics.MetricWriter, "sync", "metrics sync")
timed(tiers.TwoTiers, "save", "save (all of it)")
timed(checkpointer.Checkpointer, "wait", "wait for the previous save")
timed(checkpointer, "checksums", "checksums")
timed(ocp.CheckpointManager, "save", "orbax save (blocking part)")

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))
values = runpy.run_path(os.path.join(root, "configs", "tiny.py"))["get_config"]().to_dict()
values.update(num_train_steps=args.steps, checkpoint_every_steps=10 * args.steps,
              eval_every_steps=0, log_every_steps=10)
work = tempfile.mkdtemp(prefix="local-save-cost-")
local = tempfile.mkdtemp(dir=args.local, prefix="local-save-cost-") if args.every else ""
values.update(checkpoint_local_dir=local, checkpoint_local_every_steps=args.every)
started = time.perf_counter()
loop.train_and_evaluate(ConfigDict(values), work)
wall = time.perf_counter() - started
lines = [json.loads(x) for x in open(os.path.join(work, "metrics.jsonl"))]
train = [x for x in lines if x["split"] == "train"]
last = train[-1]
step_ms = [1000 / x["steps_per_sec"] for x in train if x["step"] > 10]  # after the first window
result = {
    "steps": args.steps, "every": args.every, "wall_s": wall,
    "calls_s": calls,
    "median_ms": {k: 1000 * statistics.median(v[2:] or v) for k, v in calls.items()},
    "step_ms_median": statistics.median(step_ms),
    "step_ms_windows": step_ms,
    "goodput": {k: v for k, v in last.items() if k.startswith("goodput")},
}
if args.cprofile:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    result["profile_top"] = text.getvalue().splitlines()
json.dump(result, open(args.out, "w"), indent=1)
print(json.dumps({k: result[k] for k in ("every", "median_ms", "step_ms_median")}))
shutil.rmtree(work, ignore_errors=True)
if local:
    shutil.rmtree(local, ignore_errors=True)
