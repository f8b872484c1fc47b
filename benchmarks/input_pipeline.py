"""The input pipeline alone on a file source: tokens/s per host by worker processes, and peak
host memory, on a synthetic corpus of jsonl.zst shards generated on disk.

    nice -n 10 python benchmarks/input_pipeline.py --documents=1000000 --out=/tmp/ip/1m.json

Each worker builds the source (`configs/lm_files.py`'s data at lm_125m's rows: 2,048 tokens,
`--rows` per update) and packs every `workers`-th update, as a worker pool would (batches are a
function of the index alone). Prints and writes one JSON record: documents, shards, setup
seconds, peak RSS of one worker, tokens/s by workers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import time

import numpy as np

_LETTERS = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))


def _vocabulary(rng, size: int = 30_000) -> tuple[np.ndarray, np.ndarray]:
    """Random words of 2-9 letters (letters by English frequency) and Zipf weights."""
    letter_p = 1.0 / np.arange(1, len(_LETTERS) + 1) ** 0.7
    lengths = rng.integers(2, 10, size)
    letters = rng.choice(_LETTERS, int(lengths.sum()), p=letter_p / letter_p.sum())
    words = np.array(["".join(w) for w in np.split(letters, np.cumsum(lengths)[:-1])])
    weights = 1.0 / np.arange(1, size + 1)
    return words, weights / weights.sum()


def write_corpus(directory: str, documents: int, per_shard: int, seed: int = 0) -> int:
    """`documents` jsonl.zst documents of 50-400 words in shards of `per_shard`."""
    import zstandard

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocabulary, weights = _vocabulary(rng)
    shards = 0
    for start in range(0, documents, per_shard):
        count = min(per_shard, documents - start)
        lengths = rng.integers(50, 400, count)
        words = rng.choice(vocabulary, int(lengths.sum()), p=weights)
        cuts = np.cumsum(lengths)[:-1]
        lines = "".join('{"text": "' + " ".join(doc) + '"}\n' for doc in np.split(words, cuts))
        with open(os.path.join(directory, f"train-{shards:05d}.jsonl.zst"), "wb") as f:
            f.write(zstandard.ZstdCompressor(level=3).compress(lines.encode()))
        shards += 1
    return shards


def _worker(args) -> tuple[int, float, int, float]:
    config, worker, workers, updates = args
    from transformer.data.language_model import from_config

    start = time.perf_counter()
    source = from_config(config)
    setup = time.perf_counter() - start
    start, tokens = time.perf_counter(), 0
    for index in range(worker, updates, workers):
        pieces, placement = source.train_pieces(index)
        tokens += sum(len(p) for p, where in zip(pieces, placement, strict=True)
                      if where is not None)
    return tokens, time.perf_counter() - start, \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, setup


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--per_shard", type=int, default=100_000)
    parser.add_argument("--rows", type=int, default=32, help="rows of 2,048 tokens per update")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--dir", default="/tmp/input_pipeline")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import runpy

    corpus = os.path.join(args.dir, f"corpus-{args.documents}")
    start = time.perf_counter()
    shards = write_corpus(corpus, args.documents, args.per_shard)
    written = time.perf_counter() - start
    cfg = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "configs",
                                      "lm_files.py"))["get_config"]()
    cfg.data.update(dict(dataset=f"jsonl:{corpus}/*.jsonl.zst",
                         eval_dataset=f"jsonl:{corpus}/train-00000.jsonl.zst",
                         max_length=2048, batch_size=args.rows, vocab_size=8000,
                         vocab_sample_documents=20_000))
    cfg.model.max_len = 2048
    record = {"documents": args.documents, "shards": shards, "per_shard": args.per_shard,
              "rows_per_update": args.rows, "tokens_per_row": 2048, "write_s": round(written, 1),
              "cpus": os.cpu_count(), "by_workers": {}}
    try:
        for workers in map(int, args.workers.split(",")):
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                results = pool.map(_worker, [(cfg, w, workers, args.updates)
                                             for w in range(workers)])
            tokens = sum(r[0] for r in results)
            seconds = max(r[1] for r in results)
            record["by_workers"][workers] = {
                "tokens_per_s": round(tokens / seconds), "setup_s": round(results[0][3], 1),
                "peak_rss_gib_per_worker": round(max(r[2] for r in results) / 2**30, 3)}
            print(json.dumps({"workers": workers, **record["by_workers"][workers]}), flush=True)
    finally:
        shutil.rmtree(corpus, ignore_errors=True)
    print(json.dumps(record))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
