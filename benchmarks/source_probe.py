"""Does an encoder-decoder read its source? Perplexity with the true sources against random ones.

    python benchmarks/source_probe.py --workdir=runs/t5_translate [--step=N] [--batches=5] \
        [--unigram_batches=1000] [--out=probe.json]

For a trained encoder-decoder run (translation or span corruption), the unsmoothed validation
perplexity of its first `--batches` eval batches twice: as they are, and with every source
token (each non-padding position of `inputs`) replaced by a piece drawn uniformly from the
vocabulary (seeded), segment ids and positions unchanged. A model that reads its source loses
much with random sources (a translation model trained from scratch here: 22.7 -> 213.5). One
that leans on its decoder's language model loses little. Also printed: the root mean square of
each parameter group's weights (output projection, embeddings, attention, feed-forward), where
a pretrained model that differs from a scratch one shows it. And a floor to read them against:
the perplexity of a unigram model on the same targets, each ordinary token at its frequency
among the ordinary target tokens of the first `--unigram_batches` training batches (add-one),
sentinels and EOS free (probability 1): what knowing only token frequencies and the layout of
the targets buys. A model near it has learned little else.

Prints one line per figure and writes them as JSON to `--out` (the record a results page cites).
Used for docs/results/2026-12-04-span-corruption-transfer.md.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from transformer.data import make_source  # noqa: E402
from transformer.data.tokenizer import FIRST_ORDINARY_ID  # noqa: E402
from transformer.inference.runs import open_run  # noqa: E402
from transformer.training import train_state  # noqa: E402
from transformer.training.evaluation import trainer_and_params  # noqa: E402
from transformer.util import cli  # noqa: E402, F401  (the CLIs' quiet start-up)

GROUPS = {"output projection": ("logits",), "embeddings": ("embed",),
          "attention": ("attention", "query", "key", "value", "out"),
          "feed-forward": ("ff_in", "ff_gate", "ff_out")}


def randomize_sources(batch: dict, vocab_size: int, first_piece: int,
                      rng: np.random.Generator) -> dict:
    """The batch [A, B, L] with each non-padding `inputs` token replaced by a uniform piece id
    in [first_piece, vocab_size) (no special piece, no sentinel). Everything else (targets,
    segment ids, positions) unchanged."""
    inputs = batch["inputs"]
    random = rng.integers(first_piece, vocab_size, size=inputs.shape, dtype=inputs.dtype)
    return {**batch, "inputs": np.where(inputs != 0, random, inputs)}


def weight_rms(params) -> dict[str, float]:
    """Root mean square of the weights in each of GROUPS (a group matched by any path part)."""
    sums = {name: [0.0, 0] for name in GROUPS}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        parts = [str(getattr(p, "key", p)) for p in path]
        if parts[-1] != "kernel" and parts[-1] != "embedding":
            continue
        for name, keys in GROUPS.items():
            if any(part in keys for part in parts[:-1]) or (name == "embeddings"
                                                            and parts[-1] == "embedding"):
                array = np.asarray(leaf, np.float64)
                sums[name][0] += float((array ** 2).sum())
                sums[name][1] += array.size
                break
    return {name: (total / count) ** 0.5 for name, (total, count) in sums.items() if count}


def unigram_perplexity(train_batches, eval_batches, vocab_size: int, free_ids) -> float:
    """Perplexity over every non-padding target token of `eval_batches` of a unigram model
    counted (add-one) on the ordinary target tokens of `train_batches`; `free_ids` (sentinels,
    EOS) cost nothing."""
    counts = np.ones(vocab_size)
    free = np.zeros(vocab_size, bool)
    free[list(free_ids)] = True
    for batch in train_batches:
        ids = batch["targets"][batch["targets_segmentation"] > 0]
        counts += np.bincount(ids[~free[ids]], minlength=vocab_size)
    counts[free] = 0
    nll = np.where(free, 0.0, -np.log(np.maximum(counts, 1) / counts.sum()))
    total = 0.0
    tokens = 0
    for batch in eval_batches:
        ids = batch["targets"][batch["targets_segmentation"] > 0]
        total, tokens = total + float(nll[ids].sum()), tokens + ids.size
    return float(np.exp(total / tokens))


def probe(workdir: str, batches: int, seed: int = 0, step: int | None = None,
          unigram_batches: int = 1000) -> dict:
    """{"step", "perplexity_true_sources", "perplexity_random_sources",
    "perplexity_unigram", "weight_rms"}."""
    run = open_run(workdir, step=step)
    if run.model.architecture != "encoder_decoder":
        raise SystemExit(f"--workdir={workdir}: model.architecture="
                         f"{run.model.architecture!r} has no source to probe; give an "
                         f"encoder-decoder run")
    source = make_source(run.config, workdir)
    trainer, params = trainer_and_params(run)
    eval_step = train_state.make_eval_step(trainer)
    rng = np.random.default_rng(seed)
    first_piece = FIRST_ORDINARY_ID + len(run.tokenizer.sentinel_ids)
    totals = {"true": {}, "random": {}}
    probed = []
    for index, local in enumerate(source.eval_batches("validation",
                                                      (0, source.eval_rows_per_batch))):
        if index == batches:
            break
        probed.append(local)
        for kind, batch in (("true", local), ("random", randomize_sources(
                local, run.model.vocab_size, first_piece, rng))):
            sums = jax.device_get(eval_step(params, train_state.global_batch(trainer.mesh, batch)))
            totals[kind] = {k: totals[kind].get(k, 0.0) + float(v) for k, v in sums.items()}
    return {"workdir": workdir, "step": run.step, "batches": batches,
            "perplexity_true_sources": train_state.eval_metrics(totals["true"])["perplexity"],
            "perplexity_random_sources": train_state.eval_metrics(totals["random"])["perplexity"],
            "perplexity_unigram": unigram_perplexity(
                (source.train_batch(i, (0, source.rows_per_batch))
                 for i in range(unigram_batches)), probed, run.model.vocab_size,
                [*run.tokenizer.sentinel_ids, run.tokenizer.eos_id]),
            "unigram_batches": unigram_batches, "weight_rms": weight_rms(params)}


def define_flags() -> None:
    """The command line's flags: defined only when run as a script (the tests import this
    file)."""
    flags.DEFINE_string("workdir", None, "A trained translation run's workdir.", required=True)
    flags.DEFINE_integer("step", None, "A checkpoint's step (default: the latest).",
                         lower_bound=0)
    flags.DEFINE_integer("batches", 5, "Validation batches probed.", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Seed of the random sources.")
    flags.DEFINE_integer("unigram_batches", 1000, "Training batches the unigram floor is "
                         "counted on.", lower_bound=1)
    flags.DEFINE_string("out", None, "Write the figures as JSON here.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    figures = probe(args.workdir, args.batches, args.seed, args.step, args.unigram_batches)
    print(f"{args.workdir} (step {figures['step']}): validation perplexity "
          f"{figures['perplexity_true_sources']:.1f} with the true sources, "
          f"{figures['perplexity_random_sources']:.1f} with random ones; a unigram model "
          f"{figures['perplexity_unigram']:.1f}")
    for name, rms in figures["weight_rms"].items():
        print(f"  weight RMS {name}: {rms:.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
