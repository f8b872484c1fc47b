"""Our decoding against the PyTorch eager peer's, side by side, on a trained translation run.

    pip install -e ".[torch]"
    python benchmarks/peers/decode.py --workdir=runs/default [--split=test]
        [--num_sentences=200] [--beam_sizes=4,1] [--batch_size=32] [--rounds=2]

Both decode the same sentences: the first `--num_sentences` of the split, encoded with the run's
vocabulary, sorted by length and cut into batches of `--batch_size` as `Translator.translate`
cuts them, with the run's weights (copied into the peer, `torch_transformer.load_params`) and
decode settings (alpha, max_extra_length). Ours is `Translator.translate_ids` (a first, untimed
pass compiles its programs). The peer is `torch_search` with as many threads as cores, also
after an untimed pass. Rounds interleave ours and the peer, so a shared machine's drift hits
both alike. Prints sentences/s of each (medians over rounds), the ratio (ours / peer), and how
many outputs are identical, then one JSON line per search. The peer computes the paper's
block with LayerNorm after each residual sum or before each sublayer (`configs/default.py`'s),
sinusoidal positions, ReLU and a tied output.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

from absl import app, flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def batches(encoded: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """`encoded` sources sorted by length, in batches (as `Translator.translate` does)."""
    order = sorted(encoded, key=len)
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _up_to_eos(row) -> tuple[int, ...]:
    from transformer.data.tokenizer import EOS_ID

    row = [int(t) for t in row]
    return tuple(row[:row.index(EOS_ID) + 1] if EOS_ID in row else row)


def ours(translator, chunks, beam_size: int, alpha: float, extra: int) -> list[tuple]:
    return [_up_to_eos(row) for chunk in chunks
            for row in translator.translate_ids(chunk, beam_size=beam_size, alpha=alpha,
                                                max_extra_length=extra)]


def theirs(model, chunks, beam_size: int, alpha: float, extra: int) -> list[tuple]:
    from benchmarks.peers import torch_search

    return [_up_to_eos(row) for chunk in chunks
            for row in torch_search.search(model, chunk, beam_size=beam_size, alpha=alpha,
                                           max_extra_length=extra).tolist()]


def compare(workdir: str, split: str, num_sentences: int, beam_sizes: list[int],
            batch_size: int, rounds: int) -> list[dict]:
    """One dict per beam size: sentences/s of ours and the peer (medians), their ratio and the
    fraction of identical outputs."""
    import jax
    import numpy as np
    import torch

    from benchmarks.peers import torch_transformer
    from transformer.data import make_source
    from transformer.inference.translator import load

    torch.set_num_threads(os.cpu_count())
    translator = load(workdir)
    sentences = [s for s, _ in make_source(translator.config, workdir).raw_pairs(
        split, num_sentences)]
    chunks = batches(translator.encode(sentences), batch_size)
    peer = torch_transformer.Transformer(translator.model_config).eval()
    torch_transformer.load_params(peer, jax.tree.map(np.asarray, translator.params))
    alpha = float(translator.config.decode.alpha)
    extra = int(translator.config.decode.max_extra_length)
    results = []
    for beam in beam_sizes:
        runs = {"ours": lambda b=beam: ours(translator, chunks, b, alpha, extra),
                "peer": lambda b=beam: theirs(peer, chunks, b, alpha, extra)}
        outputs = {name: run() for name, run in runs.items()}  # untimed: compiles, warms up
        seconds = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - started)
        rate = {name: len(sentences) / statistics.median(s) for name, s in seconds.items()}
        same = sum(a == b for a, b in zip(outputs["ours"], outputs["peer"], strict=True))
        results.append({"workdir": workdir, "split": split, "sentences": len(sentences),
                        "beam_size": beam, "batch_size": batch_size, "rounds": rounds,
                        "ours_sentences_per_sec": rate["ours"],
                        "peer_sentences_per_sec": rate["peer"],
                        "ratio": rate["ours"] / rate["peer"],
                        "identical_outputs": same / len(sentences), "threads": os.cpu_count()})
    return results


def define_flags() -> None:
    """The command line's flags: defined only when run as a script (the tests run_path this
    file)."""
    flags.DEFINE_string("workdir", None, "A trained translation run.", required=True)
    flags.DEFINE_enum("split", "test", ["validation", "test"], "The split to read.")
    flags.DEFINE_integer("num_sentences", 200, "Decode the first N sentences of the split.")
    flags.DEFINE_string("beam_sizes", "4,1", "Beam sizes to time (1: greedy).")
    flags.DEFINE_integer("batch_size", 32, "Sentences per search call.")
    flags.DEFINE_integer("rounds", 2, "Timed rounds, ours and the peer interleaved (medians).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    beams = [int(b) for b in args.beam_sizes.split(",")]
    if min(args.num_sentences, args.batch_size, args.rounds, *beams) < 1:
        sys.exit("error: --num_sentences, --batch_size, --rounds and --beam_sizes must be >= 1")
    try:
        results = compare(args.workdir, args.split, args.num_sentences, beams, args.batch_size,
                          args.rounds)
    except ValueError as error:
        sys.exit(f"error: {error}")
    print(f"{'search':<8} {'ours sent/s':>12} {'peer sent/s':>12} {'ratio':>6} {'identical':>10}")
    for r in results:
        name = "greedy" if r["beam_size"] == 1 else f"beam {r['beam_size']}"
        print(f"{name:<8} {r['ours_sentences_per_sec']:>12.1f} "
              f"{r['peer_sentences_per_sec']:>12.1f} {r['ratio']:>6.2f} "
              f"{r['identical_outputs']:>10.1%}")
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    define_flags()
    app.run(main)
