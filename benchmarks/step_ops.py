"""Where a train step's time goes on XLA:CPU, op by op.

    python benchmarks/step_ops.py --config=configs/default.py [--config.a.b=v ...] [--steps 5]
        [--warmup 3] [--top 25]

Builds the train step as `train.py` does (the same calls as `benchmarks/train_step.py`), runs
`--warmup` steps, then traces `--steps` steps with `jax.profiler`. XLA:CPU records one trace
event per executed op when `--xla_cpu_enable_xprof_traceme=true` is in XLA_FLAGS, which this
script adds before JAX starts. The events of XLA's threads are summed per step, each counted
without the ops it encloses (a `while` loop's body ops are their own events):

- by kind: the op's name without its number (`ynn_fusion`, `copy_bitcast_fusion`, `dot`, ...),
  with how many run a step and their share of the step's op time;
- the `--top` single ops, each with the Flax modules and JAX operation the compiled HLO's
  metadata names (the end of its op path), which is where a costly copy or transpose comes
  from.

Times are one core's or two cores' as the host gives them; compare shares, not milliseconds,
between machines. Prints two tables, then one JSON line.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()

import collections  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from transformer.config import resolve  # noqa: E402
from transformer.data import make_source  # noqa: E402
from transformer.parallel import sharding  # noqa: E402
from transformer.training import train_state  # noqa: E402
from transformer.util import cli  # noqa: E402, F401  (the CLIs' quiet start-up)

FLAGS = flags.FLAGS
XLA_THREAD = "tf_XLA"  # the trace lines of XLA:CPU's threads start so
# Events on those lines that are not ops: a whole program's run, a wait for worker threads
NOT_OPS = ("ThunkExecutor", "SlinkyThreadPool")
METADATA = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"')
PATH_PARTS = 4  # the last parts of an op's path shown: module, sublayer, operation


def kind(name: str) -> str:
    """An op's kind: its name without the number XLA appends (`copy_bitcast_fusion.12`)."""
    return re.sub(r"\.\d+$", "", name)


def self_times(events: list[tuple[int, int, str]]) -> collections.Counter:
    """{name: ns} over one trace line's (start, duration, name) events, each event's time
    less that of the events it encloses."""
    totals = collections.Counter()
    open_ = []  # [end, name, enclosed ns] of the events enclosing the current one
    for start, duration, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while open_ and open_[-1][0] <= start:
            end, outer, inner = open_.pop()
            totals[outer] -= inner
        if open_:
            open_[-1][2] += duration
        totals[name] += duration
        open_.append([start + duration, name, 0])
    for _, outer, inner in open_:
        totals[outer] -= inner
    return totals


def op_times(trace_dir: str) -> collections.Counter:
    """{op name: ns} summed over XLA's threads in the profile written to `trace_dir`."""
    paths = list(pathlib.Path(trace_dir).rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(paths[0]))
    totals = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith(XLA_THREAD):
                continue
            events = [(event.start_ns, event.duration_ns, event.name) for event in line.events
                      if not event.name.startswith(NOT_OPS)]
            totals.update(self_times(events))
    return totals


def sources(hlo_text: str) -> dict[str, str]:
    """{HLO instruction name: the end of its op path} from the compiled program's metadata,
    e.g. `transpose(jvp(Transformer.output_head))/.../decoder/layers_0/norm_cross/add_any`:
    the Flax modules and the JAX operation an op came from (`transpose(jvp(...))` marks the
    backward pass)."""
    found = {}
    for line in hlo_text.splitlines():
        match = METADATA.match(line)
        if match:
            name, op_name = match.groups()
            parts = op_name.split("/")
            backward = next((p for p in parts if p.startswith("transpose(")), "")
            shown = "/".join(parts[-PATH_PARTS:])
            found[name] = f"{backward + '/.../' if backward else ''}{shown}"
    return found


def profile(cfg, steps: int, warmup: int, top: int) -> dict:
    """The traced steps' op times: by kind and the `top` single ops, per step."""
    run = resolve(cfg, jax.device_count())
    cfg = run.config
    source = make_source(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train_state.build_trainer(run, mesh)
    state = train_state.init_state(trainer, int(cfg.seed))
    train_step = train_state.make_train_step(trainer, cfg)
    rows = train_state.process_rows(mesh, source.rows_per_batch)
    batches = [train_state.global_batch(mesh, source.train_batch(index, rows))
               for index in range(warmup + steps)]
    compiled = train_step.lower(state, batches[0]).compile()
    for batch in batches[:warmup]:
        state, step_metrics = compiled(state, batch)
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for batch in batches[warmup:]:
                state, step_metrics = compiled(state, batch)
            jax.block_until_ready((state, step_metrics))
        times = op_times(trace_dir)
    total = sum(times.values())
    if not total:
        raise ValueError("the trace holds no XLA:CPU op events: this view needs the CPU "
                         "backend (JAX_PLATFORMS=cpu)")
    by_kind = collections.Counter()
    count = collections.Counter()
    for name, ns in times.items():
        by_kind[kind(name)] += ns
        count[kind(name)] += 1
    where = sources(compiled.as_text())
    return {
        "steps": steps, "op_ms_per_step": total / steps / 1e6,
        "kinds": [{"kind": k, "ms": ns / steps / 1e6, "ops": count[k], "share": ns / total}
                  for k, ns in by_kind.most_common()],
        "top": [{"op": name, "ms": ns / steps / 1e6, "share": ns / total,
                 "source": where.get(name, "")} for name, ns in times.most_common(top)],
    }


def tables(result: dict, kinds: int = 20) -> str:
    lines = [f"op time {result['op_ms_per_step']:.1f} ms a step ({result['steps']} steps "
             f"traced)", "", f"{'ms/step':>8} {'ops':>5} {'share':>6}  kind"]
    lines += [f"{k['ms']:8.2f} {k['ops']:5d} {100 * k['share']:5.1f}%  {k['kind']}"
              for k in result["kinds"][:kinds]]
    lines += ["", f"{'ms/step':>8} {'share':>6}  op  source"]
    lines += [f"{t['ms']:8.2f} {100 * t['share']:5.1f}%  {t['op']}  {t['source']}"
              for t in result["top"]]
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.steps < 1 or FLAGS.warmup < 1 or FLAGS.top < 0:
        sys.exit("error: --steps and --warmup must be >= 1 and --top >= 0")
    logging.set_verbosity(logging.WARNING)
    try:
        result = profile(FLAGS.config, FLAGS.steps, FLAGS.warmup, FLAGS.top)
    except ValueError as error:
        sys.exit(f"error: {error}")
    print(tables(result))
    print(json.dumps(result))


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                    lock_config=True)
    flags.DEFINE_integer("steps", 5, "Traced steps (after the warm-up).")
    flags.DEFINE_integer("warmup", 3, "Untraced steps first.")
    flags.DEFINE_integer("top", 25, "Single ops listed with where they come from.")
    flags.mark_flags_as_required(["config"])
    app.run(main)
