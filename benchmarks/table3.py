"""The paper's Table 3: train every row of `configs/table3.py`, then write the table and a plot.

    python benchmarks/table3.py --workdir=runs/table3 [--rows=base,A_h1,...] [--scale=wmt14]

Each row trains in its own workdir (`<workdir>/<row>`) with `train.py`, so an interrupted run
resumes where it stopped and rerunning skips finished rows. The figures are each row's last
validation line: the unsmoothed per-token perplexity and sacreBLEU with beam search (on the
whole validation split at the reduced scale). Writes `<workdir>/table3.md` (the paper's columns
beside the measured ones) and `<workdir>/table3.png`. Progress: rows done, elapsed time, and an
ETA that weighs the remaining rows by their training FLOPs.
"""

from __future__ import annotations

import argparse
import pathlib
import runpy
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer import config as config_lib  # noqa: E402
from transformer import flops  # noqa: E402
from transformer import workdir as workdir_lib  # noqa: E402
from transformer.visualize import read_metrics  # noqa: E402

TABLE3 = runpy.run_path(str(ROOT / "configs" / "table3.py"))
# The paper's Table 3 (newstest2013, EN-DE): dev perplexity, dev BLEU, parameters (millions).
PAPER = {
    "base": (4.92, 25.8, 65), "A_h1": (5.29, 24.9, None), "A_h4": (5.00, 25.5, None),
    "A_h16": (4.91, 25.8, None), "A_h32": (5.01, 25.4, None), "B_dk16": (5.16, 25.1, 58),
    "B_dk32": (5.01, 25.4, 60), "C_N2": (6.11, 23.7, 36), "C_N4": (5.19, 25.3, 50),
    "C_N8": (4.88, 25.5, 80), "C_d256": (5.75, 24.5, 28), "C_d1024": (4.66, 26.0, 168),
    "C_ff1024": (5.12, 25.4, 53), "C_ff4096": (4.75, 26.2, 90), "D_drop0.0": (5.77, 24.6, None),
    "D_drop0.2": (4.95, 25.5, None), "D_ls0.0": (4.67, 25.3, None), "D_ls0.2": (5.47, 25.7, None),
    "E_learned": (4.92, 25.7, None), "big": (4.33, 26.4, 213),
}


def _argument(row: str, scale: str) -> str:
    return f"{row},{scale}" if scale == "wmt14" else row


def row_config(row: str, scale: str):
    return TABLE3["get_config"](_argument(row, scale))


def finished(workdir: pathlib.Path) -> dict | None:
    """The row's last validation figures, once its run has evaluated its last step."""
    recorded = workdir_lib.read_config_file(str(workdir))
    if recorded is None or not (workdir / workdir_lib.METRICS).exists():
        return None
    total_steps = recorded["num_train_steps"]
    validation = read_metrics(str(workdir)).get("validation", {})
    if validation.get("perplexity", [(None,)])[-1][0] != total_steps:
        return None
    return {key: points[-1][1] for key, points in validation.items()
            if points[-1][0] == total_steps}


def train_row(row: str, scale: str, workdir: pathlib.Path, extra: list[str]) -> None:
    command = [sys.executable, str(ROOT / "train.py"),
               f"--config={ROOT / 'configs' / 'table3.py'}:{_argument(row, scale)}",
               f"--workdir={workdir}", *extra]
    subprocess.run(command, check=True)


def _cost(cfg) -> float:
    model = config_lib.resolve(cfg).model
    length = int(cfg.data.max_length)
    return flops.train_flops_per_token(model, source_length=length,
                                       target_length=length) * cfg.num_train_steps


def run_rows(root: pathlib.Path, rows: list[str], scale: str, extra: list[str]) -> dict:
    costs = {row: _cost(row_config(row, scale)) for row in rows}
    started, done_cost, results = time.monotonic(), 0.0, {}
    for number, row in enumerate(rows, 1):
        workdir = root / row
        results[row] = finished(workdir)
        if results[row] is None:
            elapsed = time.monotonic() - started
            remaining = sum(costs[r] for r in rows[number - 1:])
            eta = f", ETA {elapsed / done_cost * remaining / 60:.0f} min" if done_cost else ""
            print(f"[table3] row {number}/{len(rows)} {row}: training in {workdir} "
                  f"({elapsed / 60:.0f} min so far{eta})", flush=True)
            train_row(row, scale, workdir, extra)
            done_cost += costs[row]
            results[row] = finished(workdir)
            if results[row] is None:
                raise SystemExit(f"error: {workdir} ended without a validation line at its "
                                 "last step; see its log")
    return results


def table(root: pathlib.Path, results: dict) -> str:
    """Markdown: each row's recorded config (what ran) and figures, the paper's beside."""
    head = ("| row | N | d_model | d_ff | h | d_k | d_v | P_drop | ε_ls | params | dev PPL | "
            "dev BLEU | paper PPL | paper BLEU | paper params |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row, figures in results.items():
        cfg = workdir_lib.load_config(str(root / row))
        model = config_lib.resolve(cfg).model
        params = flops.param_counts(model)["total"] / 1e6
        ppl, bleu, paper_params = PAPER[row]
        lines.append(
            f"| {row} | {model.num_encoder_layers} | {model.d_model} | {model.d_ff} | "
            f"{model.num_heads} | {model.d_k} | {model.d_v} | {model.dropout_rate} | "
            f"{cfg.label_smoothing} | {params:.1f}M | {figures['perplexity']:.2f} | "
            f"{figures.get('bleu', float('nan')):.1f} | {ppl} | {bleu} | "
            f"{'' if paper_params is None else f'{paper_params}M'} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for ax, (key, index, label) in zip(axes, (("perplexity", 0, "dev perplexity"),
                                              ("bleu", 1, "dev BLEU")), strict=True):
        rows = [row for row in results if key in results[row]]
        ours = [results[row][key] for row in rows]
        paper = [PAPER[row][index] for row in rows]
        ax.scatter(paper, ours)
        for row, x, y in zip(rows, paper, ours, strict=True):
            ax.annotate(row, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(f"paper (WMT14 newstest2013), {label}")
        ax.set_ylabel(f"measured here, {label}")
        ax.grid(alpha=0.3)
    fig.suptitle("Table 3 rows: the paper's figures against this run's")
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="one subdirectory per row")
    parser.add_argument("--rows", default=",".join(TABLE3["ROWS"]))
    parser.add_argument("--scale", choices=("reduced", "wmt14"), default="reduced")
    args, extra = parser.parse_known_args(argv)
    rows = args.rows.split(",")
    unknown = [row for row in rows if row not in TABLE3["ROWS"]]
    if unknown:
        sys.exit(f"error: --rows has unknown rows {unknown}; rows: {', '.join(TABLE3['ROWS'])}")
    root = pathlib.Path(args.workdir)
    results = run_rows(root, rows, args.scale, extra)
    markdown = table(root, results)
    (root / "table3.md").write_text(markdown)
    plot(results, root / "table3.png")
    print(markdown + f"wrote {root / 'table3.md'} and {root / 'table3.png'}")


if __name__ == "__main__":
    main(sys.argv[1:])
