"""The paper's Table 3: train every row of `configs/table3.py`, then write the table and a plot.

    python benchmarks/table3.py --workdir=runs/table3 [--rows=base,A_h1,...] [--scale=wmt14]
        [--results=docs/table3/results.json]

Each row trains in its own workdir (`<workdir>/<row>`) with `train.py`, so an interrupted run
resumes where it stopped. The figures are each row's last validation line: the unsmoothed
per-token perplexity and sacreBLEU with beam search (on the whole validation split at the
reduced scale). As each row ends, its setting, figures and wall time go into the results file
(`--results`, default `<workdir>/table3.json`), and `<workdir>/table3.md` (the paper's columns
beside the measured ones) and `<workdir>/table3.png` are rewritten. Rows already in the results
file are skipped, so a table too long for one sitting continues from a copy of that file on
another machine. An entry whose setting `configs/table3.py` no longer gives is an error before
anything trains. Progress: rows done, elapsed time, and an ETA that weighs the remaining rows by
their training FLOPs.
"""

from __future__ import annotations

import json
import pathlib
import runpy
import subprocess
import sys
import time

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.checkpoint import layout  # noqa: E402
from transformer.config import resolve  # noqa: E402
from transformer.sizing import flops  # noqa: E402
from transformer.training.curves import read_metrics  # noqa: E402

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
    recorded = layout.read_config_file(str(workdir))
    if recorded is None or not (workdir / layout.METRICS).exists():
        return None
    total_steps = recorded["num_train_steps"]
    validation = read_metrics(str(workdir)).get("validation", {})
    if validation.get("perplexity", [(None,)])[-1][0] != total_steps:
        return None
    return {key: points[-1][1] for key, points in validation.items()
            if points[-1][0] == total_steps}


def setting(cfg) -> dict:
    """What a row trains (the paper's columns, the positions and the updates) from its config."""
    model = resolve(cfg).model
    return {"N": model.num_encoder_layers, "d_model": model.d_model, "d_ff": model.d_ff,
            "h": model.num_heads, "d_k": model.d_k, "d_v": model.d_v,
            "P_drop": model.dropout_rate, "ls": cfg.label_smoothing,
            "positional": model.positional, "norm_position": model.norm_position,
            "updates": cfg.num_train_steps,
            "learning_rate": cfg.optimizer.learning_rate,
            "params": flops.param_counts(model)["total"]}


def record(row: str, workdir: pathlib.Path, figures: dict, minutes: float | None) -> dict:
    """A results-file entry: the setting the row's run recorded, its figures, its wall time
    (None when it was found finished rather than trained by this runner)."""
    return {"row": row, **setting(layout.load_config(str(workdir))),
            "perplexity": figures["perplexity"], "bleu": figures.get("bleu"),
            "minutes": minutes}


# Entries written before a key was recorded: every row committed without `norm_position`
# trained the paper's post-LN block (configs/table3.py pins it since fc62288; before, it took
# configs/default.py's block, post-LN until b0ce8ff, three minutes earlier, with no row between).
UNRECORDED = {"norm_position": "post"}


def read_results(path: pathlib.Path, rows: list[str], scale: str) -> dict:
    """The rows already in the results file, checked against what `configs/table3.py` says
    they train now: a stale entry is an error naming the row and the fix."""
    if not path.exists():
        return {}
    try:
        results = {entry["row"]: entry for entry in json.loads(path.read_text())}
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise SystemExit(f"error: {path} is not a Table 3 results file ({error}): give another "
                         "--results or remove it") from None
    for row in rows:
        if row in results:
            now = setting(row_config(row, scale))
            then = {key: results[row].get(key, UNRECORDED.get(key)) for key in now}
            if then != now:
                changed = ", ".join(f"{k} {then[k]} -> {now[k]}" for k in now if then[k] != now[k])
                raise SystemExit(f"error: {path}: row {row} was trained with another setting "
                                 f"than configs/table3.py now gives ({changed}): remove its "
                                 "entry to train it again, or give another --results")
    return results


def write_results(path: pathlib.Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(list(results.values()), indent=1) + "\n")
    path.with_suffix(".tmp").replace(path)


def train_row(row: str, scale: str, workdir: pathlib.Path, extra: list[str]) -> None:
    command = [sys.executable, str(ROOT / "train.py"),
               f"--config={ROOT / 'configs' / 'table3.py'}:{_argument(row, scale)}",
               f"--workdir={workdir}", *extra]
    subprocess.run(command, check=True)


def _cost(cfg) -> float:
    model = resolve(cfg).model
    length = int(cfg.data.max_length)
    return flops.train_flops_per_token(model, source_length=length,
                                       target_length=length) * cfg.num_train_steps


def run_rows(root: pathlib.Path, rows: list[str], scale: str, extra: list[str],
             results_path: pathlib.Path, on_row=None) -> dict:
    """Trains the rows not yet in the results file (or finished in their workdir), in order,
    adding each to the file as it ends; `on_row(results)` after each."""
    results = read_results(results_path, rows, scale)
    todo = [row for row in rows if row not in results]
    costs = {row: _cost(row_config(row, scale)) for row in todo}
    started = time.monotonic()
    done_cost = 0.0
    for number, row in enumerate(todo):
        workdir = root / row
        figures = finished(workdir)
        minutes = None
        if figures is None:
            elapsed = time.monotonic() - started
            remaining = sum(costs[r] for r in todo[number:])
            eta = f", ETA {elapsed / done_cost * remaining / 60:.0f} min" if done_cost else ""
            print(f"[table3] row {rows.index(row) + 1}/{len(rows)} {row}: training in "
                  f"{workdir} ({len(results)} rows done, {elapsed / 60:.0f} min so far{eta})",
                  flush=True)
            row_started = time.monotonic()
            train_row(row, scale, workdir, extra)
            minutes = (time.monotonic() - row_started) / 60
            done_cost += costs[row]
            figures = finished(workdir)
            if figures is None:
                raise SystemExit(f"error: {workdir} ended without a validation line at its "
                                 "last step; see its log")
        results[row] = record(row, workdir, figures, minutes)
        write_results(results_path, results)
        if on_row is not None:
            on_row(results)
    return {row: results[row] for row in rows}


def _number(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table(results: dict) -> str:
    """Markdown: each row's setting and figures, the paper's beside."""
    head = ("| row | N | d_model | d_ff | h | d_k | d_v | P_drop | ε_ls | params | dev PPL | "
            "dev BLEU | minutes | paper PPL | paper BLEU | paper params |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row, r in results.items():
        ppl, bleu, paper_params = PAPER[row]
        setting_ = (f"{r['N']} | {r['d_model']} | {r['d_ff']} | {r['h']} | {r['d_k']} | "
                    f"{r['d_v']} | {r['P_drop']} | {r['ls']}")
        if r["positional"] != "sinusoidal":
            setting_ += f" ({r['positional']} positions)"
        lines.append(
            f"| {row} | {setting_} | {r['params'] / 1e6:.2f}M | {r['perplexity']:.2f} | "
            f"{_number(r['bleu'], '.1f')} | {_number(r['minutes'], '.0f')} | {ppl} | {bleu} | "
            f"{'' if paper_params is None else f'{paper_params}M'} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: pathlib.Path) -> None:
    from transformer.util import plotting

    fig, axes = plotting.pyplot().subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for ax, (key, index, label) in zip(axes, (("perplexity", 0, "dev perplexity"),
                                              ("bleu", 1, "dev BLEU")), strict=True):
        rows = [row for row in results if results[row].get(key) is not None]
        ours = [results[row][key] for row in rows]
        paper = [PAPER[row][index] for row in rows]
        ax.scatter(paper, ours)
        for row, x, y in zip(rows, paper, ours, strict=True):
            ax.annotate(row, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(f"paper (WMT14 newstest2013), {label}")
        ax.set_ylabel(f"measured here, {label}")
        ax.grid(alpha=0.3)
    fig.suptitle("Table 3 rows: the paper's figures against this run's")
    plotting.save(fig, str(out), dpi=110)


def define_flags() -> None:
    """The command line's flags: defined only when run as a script (the tests run_path this
    file)."""
    flags.DEFINE_string("workdir", None, "One subdirectory per row.", required=True)
    flags.DEFINE_string("rows", ",".join(TABLE3["ROWS"]), "The rows to train, comma-separated.")
    flags.DEFINE_enum("scale", "reduced", ["reduced", "wmt14"], "The rows' data and length.")
    flags.DEFINE_string("results", None, "The rows' figures, read and extended (JSON); default "
                        "<workdir>/table3.json.")


def parse_known_flags(argv: list[str]) -> list[str]:
    """absl's parsing of our flags, with its one-line errors. Flags of no one here are left in
    the list returned, for train.py."""
    try:
        return flags.FLAGS(argv, known_only=True)
    except flags.Error as error:
        sys.exit(f"FATAL Flags parsing error: {error}\n"
                 f"Pass --helpshort or --helpfull to see help on flags.")


def main(argv: list[str]) -> None:
    """`argv`: the program, then what absl left: flags of no one here, passed on to every
    row's train.py."""
    args = flags.FLAGS
    extra = argv[1:]
    rows = args.rows.split(",")
    unknown = [row for row in rows if row not in TABLE3["ROWS"]]
    if unknown:
        sys.exit(f"error: --rows has unknown rows {unknown}; rows: {', '.join(TABLE3['ROWS'])}")
    root = pathlib.Path(args.workdir)
    results_path = pathlib.Path(args.results) if args.results else root / "table3.json"

    def write_table(results: dict) -> str:
        markdown = table(results)
        (root / "table3.md").write_text(markdown)
        plot(results, root / "table3.png")
        return markdown

    root.mkdir(parents=True, exist_ok=True)
    results = run_rows(root, rows, args.scale, extra, results_path, on_row=write_table)
    print(write_table(results) + f"wrote {results_path}, {root / 'table3.md'} and "
          f"{root / 'table3.png'}")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_known_flags)
