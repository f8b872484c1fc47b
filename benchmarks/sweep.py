"""Train-step tokens/s and memory against sequence length and batch size: a table and a plot.

    python benchmarks/sweep.py --config=benchmarks/workloads/cpu_small.py \
        [--lengths=32,64,128] [--batches=8,16,32] [--steps=5] [--out=sweep.png]

Runs `benchmarks/train_step.py`'s `benchmark` for every (length, rows) pair on the config's
synthetic copy task (source length - 1, target length tokens; every token real) and plots
non-pad target tokens/s and compiled memory per device against the sequence length, one line
per batch size. Prints one JSON line per point and a table. The figure needs matplotlib.
"""

from __future__ import annotations

import json
import pathlib
import runpy
import sys

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parent.parent


def sweep(config_path: str, lengths: list[int], batches: list[int], steps: int) -> list[dict]:
    benchmark = runpy.run_path(str(ROOT / "benchmarks" / "train_step.py"))["benchmark"]
    base = runpy.run_path(config_path)["get_config"]
    rows = []
    for rows_per_step in batches:
        for length in lengths:
            cfg = base()
            if cfg.data.dataset != "synthetic":
                raise ValueError(f"{config_path}: the sweep needs a synthetic-data config")
            cfg.data.update(dict(min_length=length - 1, max_length=length - 1,
                                 batch_size=rows_per_step))
            cfg.model.max_len = max(int(cfg.model.max_len), length)
            result = benchmark(cfg, steps, 1, gemm_runs=3)
            point = {"length": length, "rows": rows_per_step} | {
                k: result[k] for k in ("tokens_per_sec", "step_ms", "peak_bytes", "compile_s",
                                       "fraction_of_gemm", "mfu", "backend", "device_kind")}
            print(json.dumps(point), flush=True)
            rows.append(point)
    return rows


def plot(points: list[dict], title: str, out: str) -> None:
    from transformer.util import plotting

    fig, (speed, memory) = plotting.pyplot().subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for colour, rows in enumerate(sorted({p["rows"] for p in points})):
        line = sorted((p for p in points if p["rows"] == rows), key=lambda p: p["length"])
        lengths = [p["length"] for p in line]
        speed.plot(lengths, [p["tokens_per_sec"] for p in line], "o-", color=f"C{colour}",
                   label=f"{rows} rows")
        memory.plot(lengths, [p["peak_bytes"] / 2**20 for p in line], "o-",
                    color=f"C{colour}", label=f"{rows} rows")
    for ax, label in ((speed, "target tokens/s"), (memory, "compiled memory / device (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (target tokens per row)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend()
    speed.set_title("training throughput")
    memory.set_title("memory (temporaries + arguments + outputs)")
    fig.suptitle(title)
    plotting.save(fig, out, dpi=100)


def define_flags() -> None:
    """The command line's flags: defined only when run as a script."""
    flags.DEFINE_string("config", None, "A synthetic-data config file.", required=True)
    flags.DEFINE_string("lengths", "32,64,128", "Sequence lengths, comma-separated.")
    flags.DEFINE_string("batches", "8,16,32", "Rows per step, comma-separated.")
    flags.DEFINE_integer("steps", 5, "Timed steps per point.")
    flags.DEFINE_string("out", "sweep.png", "Where the plot goes.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    if min(lengths) < 2 or min(batches) < 1 or args.steps < 1:
        sys.exit("error: --lengths must be >= 2, --batches and --steps >= 1")
    try:
        points = sweep(args.config, lengths, batches, args.steps)
    except ValueError as error:
        sys.exit(f"error: {error}")
    print(f"{'rows':>5} {'length':>7} {'tokens/s':>9} {'step ms':>8} {'MiB':>7} {'compile s':>9}")
    for p in points:
        print(f"{p['rows']:>5} {p['length']:>7} {p['tokens_per_sec']:>9,.0f} "
              f"{p['step_ms']:>8.1f} {p['peak_bytes'] / 2**20:>7,.0f} {p['compile_s']:>9.1f}")
    plot(points, f"{pathlib.Path(args.config).stem}, {points[0]['backend']} "
                 f"({points[0]['device_kind']})", args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
