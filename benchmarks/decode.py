"""Decoding speed of a trained run: sentences/s and generated tokens/s, beam search and greedy.

    python benchmarks/decode.py --workdir=runs/default [--split=test] [--num_sentences=500]
        [--beam_sizes=4,1] [--batch_size=32] [--quantize=int8]

Loads the run like `transformer.load` (its latest checkpoint, its vocabulary), reads the first
`--num_sentences` source sentences of the split, and for each beam size translates them twice
through `Translator.translate`: the first pass compiles one search per length bucket (reported
as warm-up time), the second is timed. Generated tokens are the SentencePiece pieces of the
outputs (EOS excluded). Prints a table, then one JSON line per beam size. `--quantize=int8`
times int8 decoding (int8 kernels and KV cache; its BLEU and bytes: benchmarks/decode_int8.py).
"""

from __future__ import annotations

import json
import logging
import sys
import time

from absl import app, flags


def define_flags() -> None:
    """The command line's flags: defined only when run as a script (tests run_path this file)."""
    flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
    flags.DEFINE_enum("split", "test", ["validation", "test"], "The split to read.")
    flags.DEFINE_integer("num_sentences", 500, "Decode the first N sentences of the split.")
    flags.DEFINE_string("beam_sizes", "4,1", "Beam sizes to time (1: greedy).")
    flags.DEFINE_integer("batch_size", 32, "Sentences per search call.")
    flags.DEFINE_enum("quantize", "none", ["none", "int8"], "int8: int8 kernels and KV cache.")


def benchmark(workdir: str, split: str, num_sentences: int, beam_sizes: list[int],
              batch_size: int, quantize: str = "none") -> list[dict]:
    import jax

    from transformer.data import make_source
    from transformer.inference.translator import load

    translator = load(workdir, quantize=quantize)
    sources = [s for s, _ in make_source(translator.config, workdir).raw_pairs(
        split, num_sentences)]
    rows = []
    for beam in beam_sizes:
        started = time.perf_counter()
        translator.translate(sources, beam_size=beam, batch_size=batch_size)
        warmup = time.perf_counter() - started
        started = time.perf_counter()
        outputs = translator.translate(sources, beam_size=beam, batch_size=batch_size)
        seconds = time.perf_counter() - started
        tokens = sum(len(ids) for ids in translator.tokenizer.encode(outputs))
        rows.append({"workdir": workdir, "split": split, "sentences": len(sources),
                     "beam_size": beam, "batch_size": batch_size, "quantize": quantize,
                     "backend": jax.default_backend(),
                     "device_kind": jax.devices()[0].device_kind,
                     "first_pass_s": warmup, "seconds": seconds,
                     "sentences_per_sec": len(sources) / seconds,
                     "tokens_per_sec": tokens / seconds, "generated_tokens": tokens})
    return rows


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's INFO chatter
    beams = [int(b) for b in args.beam_sizes.split(",")]
    if args.num_sentences < 1 or args.batch_size < 1 or min(beams) < 1:
        sys.exit("error: --num_sentences, --batch_size and --beam_sizes must be >= 1")
    try:
        rows = benchmark(args.workdir, args.split, args.num_sentences, beams, args.batch_size,
                         args.quantize)
    except ValueError as error:
        sys.exit(f"error: {error}")
    print(f"{'search':<8} {'sentences':>9} {'sent/s':>8} {'tokens/s':>9} {'first pass (s)':>15}")
    for r in rows:
        name = "greedy" if r["beam_size"] == 1 else f"beam {r['beam_size']}"
        print(f"{name:<8} {r['sentences']:>9} {r['sentences_per_sec']:>8.1f} "
              f"{r['tokens_per_sec']:>9,.0f} {r['first_pass_s']:>15.1f}")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    define_flags()
    app.run(main)
