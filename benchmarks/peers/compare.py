"""Our train step against the PyTorch eager peer, measured side by side in one run.

    pip install -e ".[torch]"
    python benchmarks/peers/compare.py [--workloads=cpu_small,cpu_base] [--rounds=3]
        [--steps=6] [--warmup=2]

For each workload (`benchmarks/workloads/<name>.py`) and round, ours (`benchmarks/train_step.py`'s
`benchmark`: one JAX device, every batch built before timing) and the peer
(`benchmarks/peers/torch_transformer.py`, the same model, optimizer and token counts, as many
threads as the machine has cores) each run `--warmup` untimed steps and `--steps` timed ones,
interleaved (ours, peer, ours, peer, ...) so that a shared machine's drift hits both alike. The
float32 GEMM rate (1024^3 matmuls) is sampled in the same run by ours. Prints a table of the
median steps/s per workload, the ratio (ours / peer) and the fraction of the GEMM rate each
reaches, then one JSON line.
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import statistics
import sys
import time

from absl import app, flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def peer_steps_per_sec(cfg, shape: tuple[int, int, int], steps: int, warmup: int) -> float:
    """Median steps/s of the PyTorch peer on `cfg`'s model, `shape` = (rows, source length,
    target length) random tokens per step, every one real (as our synthetic copy task)."""
    import torch

    from benchmarks.peers.torch_transformer import make_train_step
    from transformer.config import resolve

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(int(cfg.seed))
    run = resolve(cfg, 1)
    _, step = make_train_step(run.config, run.model)
    rows, source_length, target_length = shape
    generator = torch.Generator().manual_seed(0)
    vocab = int(run.model.vocab_size)
    inputs = torch.randint(3, vocab, (warmup + steps, rows, source_length), generator=generator)
    targets = torch.randint(3, vocab, (warmup + steps, rows, target_length), generator=generator)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step(inputs[i], targets[i])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 1 / statistics.median(times)


def define_flags() -> None:
    """The command line's flags: defined only when run as a script."""
    flags.DEFINE_string("workloads", "cpu_small,cpu_base", "benchmarks/workloads/<name>.py, "
                        "comma-separated.")
    flags.DEFINE_integer("rounds", 3, "Rounds of ours then the peer, per workload.")
    flags.DEFINE_integer("steps", 6, "Timed steps per round.")
    flags.DEFINE_integer("warmup", 2, "Untimed steps first, per round.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit('error: the PyTorch peer needs torch: pip install -e ".[torch]"')
    benchmark = runpy.run_path(str(ROOT / "benchmarks" / "train_step.py"))["benchmark"]
    results = {}
    for name in args.workloads.split(","):
        path = ROOT / "benchmarks" / "workloads" / f"{name}.py"
        if not path.is_file():
            sys.exit(f"error: --workloads: no {path.relative_to(ROOT)}")
        get_config = runpy.run_path(str(path))["get_config"]
        ours = []
        peer = []
        gemm = []
        flops_per_step = None
        for round_ in range(args.rounds):
            row = benchmark(get_config(), args.steps, args.warmup, gemm_runs=5)
            ours.append(row["steps_per_sec"])
            gemm.append(row["gemm_flops_per_sec"])
            flops_per_step = row["flops_per_target_token"] * row["target_tokens_per_step"]
            shape = (row["rows_per_microbatch"] * row["grad_accum_steps"],
                     row["source_length"], row["target_length"])
            peer.append(peer_steps_per_sec(get_config(), shape, args.steps, args.warmup))
            print(f"{name} round {round_ + 1}/{args.rounds}: ours {ours[-1]:.3f} steps/s, "
                  f"peer {peer[-1]:.3f} steps/s", flush=True)
        rate = statistics.median(gemm)
        results[name] = {
            "ours_steps_per_sec": statistics.median(ours),
            "peer_steps_per_sec": statistics.median(peer),
            "ratio": statistics.median(ours) / statistics.median(peer),
            "gemm_flops_per_sec": rate,
            "ours_fraction_of_gemm": flops_per_step * statistics.median(ours) / rate,
            "peer_fraction_of_gemm": flops_per_step * statistics.median(peer) / rate,
            "rounds": {"ours": ours, "peer": peer}}
    import torch

    print(f"\n| workload | ours steps/s | PyTorch {torch.__version__} eager steps/s | ratio | "
          f"ours of GEMM | peer of GEMM |\n|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['ours_steps_per_sec']:.3f} | {r['peer_steps_per_sec']:.3f} | "
              f"{r['ratio']:.2f}x | {r['ours_fraction_of_gemm']:.0%} | "
              f"{r['peer_fraction_of_gemm']:.0%} |")
    print(json.dumps({"torch": torch.__version__, "rounds": args.rounds, "steps": args.steps,
                      "results": results}))


if __name__ == "__main__":
    define_flags()
    app.run(main)
