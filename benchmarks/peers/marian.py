"""Decoding against `transformers`: our translator and `MarianMTModel.generate` on the same
weights (the run exported to Marian), the same sentences, batches and threads, interleaved.

    pip install -e ".[torch]"
    python benchmarks/peers/marian.py --workdir=runs/wmt14_ende_base [--split=test]
        [--num_sentences=500] [--beam_sizes=4,1] [--batch_size=32] [--alpha=0.6] [--rounds=2]

The run must be one Marian expresses (post-LN, sinusoidal positions, shared tied embeddings:
`python -m transformer.convert export` refuses the others in one line, `configs/default.py`'s
pre-LN model among them). For each beam size, the rounds before the last translate with ours
alone (they compile it; theirs has nothing to compile). In the last, each batch of
`--batch_size` sentences is translated by ours (`Translator.translate_ids`), then by theirs
(`generate` with `num_beams`, `max_new_tokens` = the batch's longest source in pieces + EOS +
`decode.max_extra_length`, at most `model.max_len`, EOS forced at the last step, padding never
drawn and sources cut to `model.max_len` pieces with EOS, as ours), one after the other, so a
shared machine's drift hits both alike.
Length penalties differ: ours divides a hypothesis' log-probability by
((5 + length) / 6)^alpha (GNMT's), theirs by length^alpha (`length_penalty`). At alpha 0 both
rank by log-probability alone and their beams agree.
Prints a table (sentences/s of both, the ratio, BLEU of both, how many outputs are
identical), then one JSON line per beam size.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import time

from absl import app, flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def compare(workdir: str, sources: list[str], references: list[str] | None, *,
            beam_sizes: list[int], batch_size: int, alpha: float, rounds: int = 2) -> list[dict]:
    """One record per beam size: sentences/s and BLEU (when `references`) of ours and theirs,
    and how many of their outputs equal ours."""
    import numpy as np
    import sacrebleu
    import torch
    import transformers

    from transformer.huggingface import convert
    from transformer.inference.translator import load

    torch.set_num_threads(os.cpu_count())
    translator = load(workdir)
    extra = int(translator.config.decode.max_extra_length)
    max_len = translator.model_config.max_len  # ours stops there too
    with tempfile.TemporaryDirectory() as hf_dir:
        convert.export_workdir(workdir, hf_dir)
        model = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
        tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
    encoded = translator.encode(sources)
    records = []
    for beam in beam_sizes:
        seconds = {"ours": 0.0, "theirs": 0.0}
        outputs = {"ours": [], "theirs": []}
        for round_ in range(rounds):
            for batch in _batches(list(range(len(sources))), batch_size):
                started = time.perf_counter()
                ids = translator.translate_ids([encoded[i] for i in batch], beam_size=beam,
                                               alpha=alpha, max_extra_length=extra)
                ours = [translator.tokenizer.decode(row) for row in np.asarray(ids)]
                middle = time.perf_counter()
                if round_ < rounds - 1:
                    continue  # a warm-up round: it compiles ours; theirs has nothing to compile
                inputs = tokenizer([sources[i] for i in batch], return_tensors="pt",
                                   padding=True, truncation=True, max_length=max_len)
                with torch.no_grad():
                    tokens = model.generate(
                        **inputs, num_beams=beam, do_sample=False, length_penalty=alpha,
                        max_new_tokens=min(inputs["input_ids"].shape[1] + extra, max_len),
                        suppress_tokens=[0], forced_eos_token_id=model.config.eos_token_id)
                theirs = tokenizer.batch_decode(tokens, skip_special_tokens=True)
                ended = time.perf_counter()
                outputs["ours"] += ours
                outputs["theirs"] += theirs
                seconds["ours"] += middle - started
                seconds["theirs"] += ended - middle
        timed = len(sources)
        record = {"beam_size": beam, "alpha": alpha, "num_sentences": len(sources),
                  "batch_size": batch_size, "threads": torch.get_num_threads(),
                  "ours_sentences_per_sec": timed / seconds["ours"],
                  "theirs_sentences_per_sec": timed / seconds["theirs"],
                  "identical": sum(a == b for a, b in zip(outputs["ours"], outputs["theirs"],
                                                          strict=True))}
        record["speedup"] = record["ours_sentences_per_sec"] / record["theirs_sentences_per_sec"]
        if references is not None:
            for name in ("ours", "theirs"):
                record[f"{name}_bleu"] = sacrebleu.corpus_bleu(outputs[name],
                                                               [references]).score
        records.append(record)
    return records


def define_flags() -> None:
    """The command line's flags: defined only when run as a script (the tests run_path this
    file)."""
    flags.DEFINE_string("workdir", None, "A post-LN translation run.", required=True)
    flags.DEFINE_enum("split", "test", ["validation", "test"], "The split to read.")
    flags.DEFINE_integer("num_sentences", 500, "Translate the first N sentences of the split.")
    flags.DEFINE_string("beam_sizes", "4,1", "Beam sizes (1: greedy).")
    flags.DEFINE_integer("batch_size", 32, "Sentences per search call.")
    flags.DEFINE_float("alpha", None, "Length penalty of both (default: the run's "
                       "decode.alpha).")
    flags.DEFINE_integer("rounds", 2, "Those before the last run ours alone, to compile it.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    # First: MarianMTModel's import loads torch's triton, whose libtriton.so segfaults when it
    # loads after jaxlib has initialised (seen here: dmesg, faulthandler in triton/knobs.py).
    from transformers import MarianMTModel  # noqa: F401

    from transformer.checkpoint import layout
    from transformer.config import resolve
    from transformer.data import make_source

    run = resolve(layout.load_config(args.workdir))
    pairs = make_source(run.config, args.workdir).raw_pairs(args.split, args.num_sentences)
    alpha = float(run.config.decode.alpha if args.alpha is None else args.alpha)
    records = compare(args.workdir, [s for s, _ in pairs], [t for _, t in pairs],
                      beam_sizes=[int(b) for b in args.beam_sizes.split(",")],
                      batch_size=args.batch_size, alpha=alpha, rounds=args.rounds)
    print(f"{'beam':>4} {'ours sent/s':>12} {'theirs sent/s':>14} {'ratio':>6} "
          f"{'ours BLEU':>10} {'theirs BLEU':>12} {'identical':>10}")
    for r in records:
        print(f"{r['beam_size']:>4} {r['ours_sentences_per_sec']:>12.2f} "
              f"{r['theirs_sentences_per_sec']:>14.2f} {r['speedup']:>6.2f} "
              f"{r['ours_bleu']:>10.2f} {r['theirs_bleu']:>12.2f} "
              f"{r['identical']:>6}/{r['num_sentences']}")
    for r in records:
        print(json.dumps(r))


if __name__ == "__main__":
    define_flags()
    app.run(main)
