"""Attention forward + backward: compile time, run time and compiled memory per implementation.

    python benchmarks/attention.py [--lengths 512,1024,2048,4096,8192] [--batch 1 --heads 4
        --head_dim 64] [--implementations xla,chunked,chunked/window=256,linear] [--runs 3]
        [--plot attention.png]

For each length S (self-attention, T = S, causal mask) and implementation, compiles
`jax.grad(lambda q, k, v: attention(q, k, v).sum(), argnums=(0, 1, 2))` ahead of time, reads the
compiled program's memory (`.compile().memory_analysis()`: temporaries, arguments, outputs) and,
when that fits the memory budget, runs it and reports the median wall time of up to --runs
calls after a warm-up call (fewer when a row passes --row_budget_s; a first call over that
budget is the one timing reported). Programs over the
budget are reported from memory_analysis only. Prints one JSON line per row as it finishes, then
a table.

Implementations: "xla" and "chunked" from `transformer.ops.attention` with the causal mask
`make_causal_mask(S)` built inside the program; "chunked/nomask" is "chunked" without any mask,
a diagnostic row that shows how much of chunked's memory is the boolean [T, S] causal mask
(which the chunked path splits into key blocks and keeps as a backward residual: O(T·S) bytes).
"chunked/window=W" is a causal sliding window (`local_window_size=(W, 0)`, no mask array: the
kernel visits only the key blocks of each query block's band; "+global=G": the first G positions
are global tokens, `global_tokens=G`), "linear" causal linear attention
(`attention.linear_attention`, elu + 1 features). An implementation whose run at one length
took more than --stop_after_s is not run at the longer ones (its rows say "skipped").
`--plot` draws time and memory against length, one line per implementation (matplotlib, the
`viz` extra). The defaults (batch 1, 4 heads of 64) finish in a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from transformer.ops import attention, masks  # noqa: E402

IMPLEMENTATIONS = ("xla", "chunked", "chunked/nomask", "chunked/window=256",
                   "chunked/window=1024", "chunked/window=256+global=64", "linear")
DEFAULT_IMPLEMENTATIONS = ("xla", "chunked", "chunked/window=256", "chunked/window=1024",
                           "linear")


def _memory_budget() -> int:
    """Bytes a program may use to be run: the device's limit (GPU/TPU), else half the RAM."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] * 0.9)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _loss(implementation: str, key_chunk_size: int):
    impl, _, variant = implementation.partition("/")

    def loss(q, k, v):
        if impl == "linear":
            out = attention.linear_attention(q, k, v, causal=True)
        elif variant.startswith("window="):
            window, _, global_tokens = variant.removeprefix("window=").partition("+global=")
            out = attention.dot_product_attention(
                q, k, v, implementation=impl, key_chunk_size=key_chunk_size,
                local_window_size=(int(window), 0), global_tokens=int(global_tokens or 0))
        else:
            mask = None if variant == "nomask" else masks.make_causal_mask(q.shape[1])
            out = attention.dot_product_attention(q, k, v, mask=mask, implementation=impl,
                                                  key_chunk_size=key_chunk_size)
        return out.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def benchmark(implementation: str, length: int, args, budget: int) -> dict:
    shape = (args.batch, length, args.heads, args.head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, shape, args.dtype) for key in keys)
    start = time.perf_counter()
    compiled = jax.jit(_loss(implementation, args.key_chunk_size)).lower(q, k, v).compile()
    row = {"implementation": implementation, "length": length, "batch": args.batch,
           "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype,
           "compile_s": round(time.perf_counter() - start, 3)}
    memory = compiled.memory_analysis()
    for name in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                 "peak_memory_in_bytes"):
        row[name.removesuffix("_in_bytes")] = int(getattr(memory, name, 0) or 0)
    needed = row["temp_size"] + row["argument_size"] + row["output_size"]
    row["ran"] = needed <= budget
    row["median_s"], row["runs"] = None, 0
    if row["ran"]:
        # The first call is a warm-up; further calls are timed until --runs or --row_budget_s.
        # When even the first call is over budget, it is the only (and reported) timing.
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times = [time.perf_counter() - start]
        elapsed = time.perf_counter() - start
        if elapsed < args.row_budget_s:
            times = []
            while len(times) < args.runs and (not times or elapsed < args.row_budget_s):
                start = time.perf_counter()
                jax.block_until_ready(compiled(q, k, v))
                times.append(time.perf_counter() - start)
                elapsed += times[-1]
        row["median_s"], row["runs"] = round(statistics.median(times), 4), len(times)
    return row


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def table(rows: list[dict]) -> str:
    header = (f"{'impl':<20} {'S=T':>6} {'compile s':>9} {'median s':>9} {'runs':>4} "
              f"{'temp MiB':>10} "
              f"{'args MiB':>9} {'out MiB':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['implementation']:<20} {r['length']:>6} skipped: {r['skipped']}")
            continue
        median = "not run" if r["median_s"] is None else f"{r['median_s']:.4f}"
        lines.append(f"{r['implementation']:<20} {r['length']:>6} {r['compile_s']:>9.2f} "
                     f"{median:>9} {r['runs']:>4} {_mib(r['temp_size']):>10} "
                     f"{_mib(r['argument_size']):>9} {_mib(r['output_size']):>8}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Run time and compiled temporary memory against length, one line per implementation."""
    from transformer.util import plotting

    fig, (time_ax, memory_ax) = plotting.pyplot().subplots(1, 2, figsize=(11, 4.2))
    for impl in dict.fromkeys(r["implementation"] for r in rows):
        mine = [r for r in rows if r["implementation"] == impl and not r.get("skipped")]
        timed = [r for r in mine if r["median_s"] is not None]
        time_ax.plot([r["length"] for r in timed], [r["median_s"] for r in timed], "o-",
                     label=impl)
        memory_ax.plot([r["length"] for r in mine], [r["temp_size"] / 2**20 for r in mine],
                       "o-", label=impl)
    for ax, label in ((time_ax, "forward + backward, s"), (memory_ax, "temporaries, MiB")):
        ax.set(xscale="log", yscale="log", xlabel="sequence length T = S", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
    time_ax.legend(fontsize=8)
    fig.suptitle("Causal attention on " + jax.default_backend())
    fig.tight_layout()
    plotting.save(fig, path, dpi=120)


def _known_implementations(implementations: list[str]) -> bool:
    for impl in implementations:
        if impl.partition("/")[0] not in attention.IMPLEMENTATIONS + ("linear",):
            raise flags.ValidationError(f"{impl!r} is not one of {', '.join(IMPLEMENTATIONS)} "
                                        f"(or cudnn on a GPU)")
    return True


def define_flags() -> None:
    """The command line's flags: defined only when run as a script."""
    flags.DEFINE_list("lengths", "512,1024,2048,4096,8192", "Sequence lengths S (= T).")
    flags.DEFINE_integer("batch", 1, "Rows.", lower_bound=1)
    flags.DEFINE_integer("heads", 4, "Attention heads.", lower_bound=1)
    flags.DEFINE_integer("head_dim", 64, "Width of a head.", lower_bound=1)
    flags.DEFINE_string("dtype", "float32", "Of q, k and v.")
    flags.DEFINE_list("implementations", ",".join(DEFAULT_IMPLEMENTATIONS),
                      f"Of {', '.join(IMPLEMENTATIONS)} (any chunked/window=W).")
    flags.register_validator("implementations", _known_implementations)
    flags.DEFINE_integer("key_chunk_size", attention.DEFAULT_KEY_CHUNK_SIZE,
                         "The chunked path's key block.", lower_bound=1)
    flags.DEFINE_integer("runs", 3, "Timed runs after one warm-up.", lower_bound=1)
    flags.DEFINE_float("row_budget_s", 10.0, "Stop timing a row after this many seconds (at "
                       "least one run).")
    flags.DEFINE_float("stop_after_s", 60.0, "Skip an implementation's longer lengths after a "
                       "run this long.")
    flags.DEFINE_string("plot", None, "Write a plot of the table here (.png).")
    flags.DEFINE_float("memory_budget_gib", None, "Run only programs needing less (default: the "
                       "device's limit, or half the host RAM on CPU).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    budget = (int(args.memory_budget_gib * 2**30) if args.memory_budget_gib is not None
              else _memory_budget())
    implementations = args.implementations
    print(f"# backend {jax.default_backend()}, {jax.device_count()} device(s), memory budget "
          f"{budget / 2**30:.1f} GiB", flush=True)
    rows = []
    too_slow = {}
    for length in map(int, args.lengths):
        for impl in implementations:
            if impl in too_slow:
                rows.append({"implementation": impl, "length": length,
                             "skipped": f"{too_slow[impl]:.0f} s at a shorter length"})
            else:
                rows.append(benchmark(impl, length, args, budget))
                if (rows[-1]["median_s"] or 0) > args.stop_after_s:
                    too_slow[impl] = rows[-1]["median_s"]
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"# plot: {args.plot}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
