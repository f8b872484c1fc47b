"""The training loop's input alone: tokens/s of the batches one host produces with `data.workers`
= 0 (the loop calls `train_batch` itself), 1, 2, ... Grain worker processes
(`transformer/data/workers.py`), on the synthetic jsonl.zst corpus of `input_pipeline.py`.

    JAX_PLATFORMS=cpu nice -n 10 python benchmarks/input_workers.py --documents=200000 \
        --workers=0,1,2 --repeats=2 --out=/tmp/iw/200k.json

`configs/lm_files.py:125m`'s data at lm_125m's rows (2,048 tokens, `--rows` per update, all of
them this host's). The main process builds the source once in a workdir (vocabulary, row counts)
as the loop does. Each variant then reads `--updates` batches after `max(1, workers)` warm-up
batches (a worker's start: building its source, decoding its first window of shards). Variants
run interleaved, `--repeats` times each. Tokens are the batches' non-padding tokens. Prints and
writes one JSON record with the load average around each measurement. A rate over no measured
time, as the CPU time of a few updates can be, is null.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import time

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))


def _config(corpus: str, rows: int):
    cfg = runpy.run_path(os.path.join(HERE, "..", "configs", "lm_files.py"))["get_config"]("125m")
    cfg.data.update(dict(dataset=f"jsonl:{corpus}/*.jsonl.zst",
                         eval_dataset=f"jsonl:{corpus}/train-0000-00000.jsonl.zst",
                         batch_size=rows, vocab_size=8000, vocab_sample_documents=20_000))
    cfg.model.vocab_size = 8000
    cfg.grad_accum_steps = 1
    return cfg


def _cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and its live children (the
    workers), from /proc (Linux)."""
    me = os.getpid()
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(entry) == me or int(fields[1]) == me:  # fields[1]: the parent's pid
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _per_second(count: int, seconds: float) -> int | None:
    """`count / seconds` rounded, or None when no time was counted: the CPU time, read in clock
    ticks from /proc, can be 0 over a few updates."""
    if seconds <= 0:
        return None
    return round(count / seconds)


def _measure(source, cfg, workdir: str, rows: int, workers: int, start: int,
             updates: int) -> dict:
    from transformer.data.workers import TrainBatches

    warmup = max(1, workers)
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    batches = TrainBatches(source, cfg, workdir, (0, rows), start=start,
                           count=warmup + updates, workers=workers)
    try:
        for _ in range(warmup):
            next(batches)
        warm = time.perf_counter()
        cpu_at_warm = _cpu_seconds()
        tokens = 0
        for _ in range(updates):
            tokens += int((next(batches)["targets_segmentation"] > 0).sum())
        seconds = time.perf_counter() - warm
        cpu = _cpu_seconds() - cpu_at_warm
    finally:
        batches.close()
    return {"workers": workers, "tokens_per_s": _per_second(tokens, seconds),
            "cpu_s": round(cpu, 1), "tokens_per_cpu_s": _per_second(tokens, cpu),
            "warmup_s": round(warm - began, 1), "seconds": round(seconds, 1),
            "tokens": tokens, "load_1min": [round(load_before, 2),
                                            round(os.getloadavg()[0], 2)]}


def _by_workers(runs: list[dict], key: str) -> dict[int, list[int]]:
    """Each worker count's figures of `key`, sorted. Runs without the figure, None, are left
    out."""
    figures = {}
    for run in runs:
        if run[key] is not None:
            figures.setdefault(run["workers"], []).append(run[key])
    return {workers: sorted(values) for workers, values in figures.items()}


def define_flags() -> None:
    """The command line's flags: defined only when run as a script."""
    flags.DEFINE_integer("documents", 200_000, "Documents written.", lower_bound=1)
    flags.DEFINE_integer("per_shard", 25_000, "Documents per shard.", lower_bound=1)
    flags.DEFINE_integer("rows", 32, "Rows of 2,048 tokens per update.", lower_bound=1)
    flags.DEFINE_integer("updates", 100, "Timed updates per variant.", lower_bound=1)
    flags.DEFINE_string("workers", "0,1,2", "Worker counts to time, comma-separated.")
    flags.DEFINE_integer("repeats", 2, "Rounds over the worker counts.", lower_bound=1)
    flags.DEFINE_string("dir", "/tmp/input_workers", "Where the corpus and run are written "
                        "(and removed after).")
    flags.DEFINE_string("out", None, "Write the record (JSON) here.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    import sys

    sys.path.insert(0, HERE)
    from input_pipeline import write_corpus, write_record

    from transformer.data import make_source

    corpus = os.path.join(args.dir, "corpus")
    workdir = os.path.join(args.dir, "run")
    shutil.rmtree(args.dir, ignore_errors=True)
    start = time.perf_counter()
    shards = write_corpus(corpus, args.documents, args.per_shard)
    written = time.perf_counter() - start
    cfg = _config(corpus, args.rows)
    start = time.perf_counter()
    source = make_source(cfg, workdir)
    record = {"documents": args.documents, "shards": shards, "per_shard": args.per_shard,
              "rows_per_update": args.rows, "tokens_per_row": 2048,
              "docs_per_update": source.docs_per_batch, "write_s": round(written, 1),
              "source_setup_s": round(time.perf_counter() - start, 1),
              "cpus": os.cpu_count(), "runs": []}
    try:
        index = 0  # each run reads fresh updates: no page cache or window reuse between runs
        for _ in range(args.repeats):
            for workers in map(int, args.workers.split(",")):
                run = _measure(source, cfg, workdir, args.rows, workers, index, args.updates)
                index += max(1, workers) + args.updates
                record["runs"].append(run)
                print(json.dumps(run), flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    for key in ("tokens_per_s", "tokens_per_cpu_s"):
        record[f"{key}_by_workers"] = _by_workers(record["runs"], key)
    write_record(record, args.out)


if __name__ == "__main__":
    define_flags()
    app.run(main)
