"""The input pipeline alone on a file source: tokens/s per host by worker processes, and peak
host memory, on a synthetic corpus of jsonl.zst or parquet shards generated on disk.

    nice -n 10 python benchmarks/input_pipeline.py --documents=1000000 --out=/tmp/ip/1m.json
    python benchmarks/input_pipeline.py --format=parquet --documents=1000000 --copies=50 \
        --per_shard=50000 --workers=1 --out=/tmp/ip/50m.json   # 50M documents, 1M written

One process first builds the source as process 0 of a run does (`configs/lm_files.py`'s data
at lm_125m's rows: 2,048 tokens, `--rows` per update; it trains the vocabulary and records the
shards' rows and the mean document length in a workdir: `prepare_s`). Each worker then builds
it from those records, as the other processes and a resumed run do (`setup_s`), and packs
every `workers`-th update, as a worker pool would (batches are a function of the index alone).
Prints and writes one JSON record: documents, shards, setup seconds, peak RSS of one worker,
tokens/s by workers, the share of the rows' tokens filled
(`--pack_groups`: data.pack_groups, first-fit in groups of rows) and the shards a worker decoded.
`--processes=N` measures the host of process 0 of N: it packs only the first N-th of each
update's rows (`train_batch`), reading only its packing groups' shards when
`--pack_groups` is N or a multiple:

    python benchmarks/input_pipeline.py --format=parquet --per_shard=10000 --rows=256 \
        --processes=8 --pack_groups=8 --workers=1 --out=/tmp/ip/8_hosts.json
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time

import numpy as np
from absl import app, flags

_LETTERS = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
SUFFIX = {"jsonl": "jsonl.zst", "parquet": "parquet"}


def _vocabulary(rng, size: int = 30_000) -> tuple[np.ndarray, np.ndarray]:
    """Random words of 2-9 letters (letters by English frequency) and Zipf weights."""
    letter_p = 1.0 / np.arange(1, len(_LETTERS) + 1) ** 0.7
    lengths = rng.integers(2, 10, size)
    letters = rng.choice(_LETTERS, int(lengths.sum()), p=letter_p / letter_p.sum())
    words = np.array(["".join(w) for w in np.split(letters, np.cumsum(lengths)[:-1])])
    weights = 1.0 / np.arange(1, size + 1)
    return words, weights / weights.sum()


def write_corpus(directory: str, documents: int, per_shard: int, seed: int = 0,
                 file_format: str = "jsonl", copies: int = 1) -> int:
    """`documents` documents of 50-400 words in shards of `per_shard` (jsonl.zst or parquet),
    then `copies` - 1 hard links of every shard under new names: `copies` x `documents`
    documents in distinct shards to the reader, written once."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocabulary, weights = _vocabulary(rng)
    written = []
    for start in range(0, documents, per_shard):
        count = min(per_shard, documents - start)
        lengths = rng.integers(50, 400, count)
        words = rng.choice(vocabulary, int(lengths.sum()), p=weights)
        texts = [" ".join(doc) for doc in np.split(words, np.cumsum(lengths)[:-1])]
        path = os.path.join(directory, f"train-0000-{len(written):05d}.{SUFFIX[file_format]}")
        if file_format == "parquet":
            pq.write_table(pa.table({"text": texts}), path)
        else:
            lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
            with open(path, "wb") as f:
                f.write(zstandard.ZstdCompressor(level=3).compress(lines.encode()))
        written.append(path)
    for copy in range(1, copies):
        for path in written:
            os.link(path, path.replace("train-0000-", f"train-{copy:04d}-"))
    return len(written) * copies


def write_record(record: dict, out: str | None) -> None:
    """Print `record` as one JSON line and, with `out`, write it there (indented)."""
    print(json.dumps(record))
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(record, f, indent=1)


def _peak_rss() -> int:
    """This process's own resident high-water mark in bytes (Linux's VmHWM). Not getrusage's
    ru_maxrss: Linux carries the spawning process's peak into a spawned child across exec, so a
    worker would report the main process's memory after writing the corpus."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


def _prepare(args) -> float:
    config, workdir = args
    from transformer.data.language_model import from_config

    start = time.perf_counter()
    from_config(config, workdir)
    return time.perf_counter() - start


def _worker(args) -> tuple[int, float, int, float, int]:
    config, workdir, worker, workers, updates, processes = args
    from transformer.data.language_model import from_config

    start = time.perf_counter()
    source = from_config(config, workdir)
    setup = time.perf_counter() - start
    reader = source.files["train"]._reader
    decoded = []
    read = reader.read
    reader.read = lambda path: decoded.append(path) or read(path)
    rows = (0, source.rows_per_batch // processes)
    start = time.perf_counter()
    tokens = 0
    for index in range(worker, updates, workers):
        if processes == 1:
            pieces, placement = source.train_pieces(index)
            tokens += sum(len(p) for p, where in zip(pieces, placement, strict=True)
                          if where is not None)
        else:
            tokens += int((source.train_batch(index, rows)["targets_segmentation"] > 0).sum())
    return tokens, time.perf_counter() - start, \
        _peak_rss(), setup, len(set(decoded))


def define_flags() -> None:
    """The command line's flags: defined only when run as a script (input_workers.py imports
    this file)."""
    flags.DEFINE_integer("documents", 1_000_000, "Documents written.", lower_bound=1)
    flags.DEFINE_integer("per_shard", 100_000, "Documents per shard.", lower_bound=1)
    flags.DEFINE_integer("rows", 32, "Rows of 2,048 tokens per update.", lower_bound=1)
    flags.DEFINE_integer("updates", 8, "Timed updates per worker count.", lower_bound=1)
    flags.DEFINE_string("workers", "1,2", "Worker counts to time, comma-separated.")
    flags.DEFINE_string("dir", "/tmp/input_pipeline", "Where the corpus is written (and "
                        "removed after).")
    flags.DEFINE_enum("format", "jsonl", sorted(SUFFIX), "The shards' file format.")
    flags.DEFINE_integer("copies", 1, "Hard-linked copies of the corpus' shards: --documents x "
                         "--copies documents read, --documents written.", lower_bound=1)
    flags.DEFINE_integer("pack_groups", 1, "data.pack_groups.", lower_bound=1)
    flags.DEFINE_integer("processes", 1, "Measure process 0 of this many: the first N-th of the "
                         "rows.", lower_bound=1)
    flags.DEFINE_string("out", None, "Write the record (JSON) here.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    import runpy

    corpus = os.path.join(args.dir, f"corpus-{args.documents}x{args.copies}")
    start = time.perf_counter()
    shards = write_corpus(corpus, args.documents, args.per_shard, file_format=args.format,
                          copies=args.copies)
    written = time.perf_counter() - start
    suffix = SUFFIX[args.format]
    cfg = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "configs",
                                      "lm_files.py"))["get_config"]()
    cfg.data.update(dict(dataset=f"{args.format}:{corpus}/*.{suffix}",
                         eval_dataset=f"{args.format}:{corpus}/train-0000-00000.{suffix}",
                         max_length=2048, batch_size=args.rows, vocab_size=8000,
                         vocab_sample_documents=20_000, pack_groups=args.pack_groups))
    cfg.model.max_len = 2048
    record = {"documents": args.documents * args.copies, "documents_written": args.documents,
              "format": args.format, "shards": shards, "per_shard": args.per_shard,
              "rows_per_update": args.rows, "tokens_per_row": 2048, "write_s": round(written, 1),
              "pack_groups": args.pack_groups, "processes": args.processes,
              "cpus": os.cpu_count(), "by_workers": {}}
    workdir = os.path.join(corpus, "run")
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            record["prepare_s"] = round(pool.map(_prepare, [(cfg, workdir)])[0], 1)
        for workers in map(int, args.workers.split(",")):
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                results = pool.map(_worker, [(cfg, workdir, w, workers, args.updates,
                                              args.processes) for w in range(workers)])
            tokens = sum(r[0] for r in results)
            seconds = max(r[1] for r in results)
            record["by_workers"][workers] = {
                "tokens_per_s": round(tokens / seconds), "setup_s": round(results[0][3], 1),
                "row_fill": round(tokens * args.processes / (args.updates * args.rows * 2048), 4),
                "peak_rss_gib_per_worker": round(max(r[2] for r in results) / 2**30, 3),
                "shards_decoded_per_worker": max(r[4] for r in results)}
            print(json.dumps({"workers": workers, **record["by_workers"][workers]}), flush=True)
    finally:
        shutil.rmtree(corpus, ignore_errors=True)
    write_record(record, args.out)


if __name__ == "__main__":
    define_flags()
    app.run(main)
