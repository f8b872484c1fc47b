"""Scoring a split: perplexity over a source's eval batches (the loop's validation), a
translation run's test figures (perplexity and both BLEUs, like the paper's Table 2: what
`python -m transformer.evaluate` prints), and an image classifier's loss, accuracy, top-5 accuracy
and confusion matrix.

Shapes: B rows, C classes.
"""

from __future__ import annotations

import json
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from transformer.checkpoint import averaging, layout
from transformer.data import make_source
from transformer.inference.runs import Run, open_run
from transformer.inference.translator import from_run, require_translation
from transformer.parallel import distributed, sharding
from transformer.training import health, metrics, scores, train_state
from transformer.training.metrics import MetricWriter
from transformer.util import atomic, progress

log = logging.getLogger("transformer")
SCORED_KEY = "transformer/scored"  # process 0 has scored the trained run (score_trained_run)
SCORABLE = ("encoder_decoder", "vision")  # what evaluate_run scores: translation, images


def evaluate(trainer, eval_step, params, source, rows, split="validation") -> dict:
    """Unsmoothed eval loss and perplexity (a classifier: loss and accuracy,
    `train_state.eval_metrics`) over the source's eval batches of `split` (progress on stderr
    from process 0)."""
    totals = {"nll_sum": 0.0, "tokens": 0.0}
    with progress.bar(None, f"evaluating on {split}", unit="batch",
                      show=jax.process_index() == 0) as bar:
        for local in source.eval_batches(split, rows):
            sums = jax.device_get(eval_step(params, train_state.global_batch(trainer.mesh, local)))
            totals = health.add_eval_sums(totals, sums)  # sums; the logit maxima: max
            bar.update()
    return train_state.eval_metrics(totals)


def evaluate_run(workdir: str, split: str, *, step=None, average=None, num_sentences=None,
                 beam_size=None, alpha=None) -> dict:
    """What `python -m transformer.evaluate` scores: a translation run's perplexity and BLEU
    (`evaluate_translation`), or an image classifier's figures (`evaluate_classifier`)."""
    def check(model) -> None:
        if model.architecture != "vision":
            require_translation(workdir, model)

    run = open_run(workdir, step=step, average=average, vocabulary="auto", check=check)
    if run.model.architecture == "vision":
        return evaluate_classifier(run, split)
    return evaluate_translation(run, split, num_sentences=num_sentences, beam_size=beam_size,
                                alpha=alpha)


def check_scorable(model, split: str) -> None:
    """One line, before training, where `evaluate_run` could not score the trained run."""
    if model.architecture not in SCORABLE:
        raise ValueError(f"--score_split={split}: scoring after training takes a translation "
                         f"model or an image classifier, not model.architecture="
                         f"{model.architecture!r}; leave it out (the validation figures are in "
                         f"metrics.jsonl)")


def score_trained_run(workdir: str, split: str) -> dict | None:
    """`evaluate_run(workdir, split)` at the end of training, in every process of the run.
    It scores on one device, process 0's (`open_run`'s mesh): process 0 scores and returns the
    figures. The others read the checkpoint with it (orbax's restore ends in a barrier of all
    processes), then wait for it on a key of the coordination service (no barrier, whose
    timeout a long decode could pass) and return None. An error in process 0 stops them all
    (`distributed.FailureNotices`)."""
    if jax.process_count() == 1:
        return evaluate_run(workdir, split)
    from jax._src import distributed as jax_distributed  # no public handle to the client

    client = jax_distributed.global_state.client
    with distributed.FailureNotices():
        if jax.process_index() == 0:
            figures = evaluate_run(workdir, split)
            client.key_value_set(SCORED_KEY, "1")
            return figures
        averaging.load_params(workdir)  # what open_run reads, with process 0
        client.blocking_key_value_get(SCORED_KEY, 2**31 - 1)  # ms: 24 days
        return None


def decoded_rows(sentences: int, batch_size: int = 32) -> int:
    """Rows `Translator.translate` decodes for `sentences`: batches of `batch_size` (its
    default), each padded to a power of two rows. What a decode's time scales with (the ETA's
    test decode from a validation one), give or take the sentences' lengths."""
    full, rest = divmod(sentences, batch_size)
    return full * batch_size + (1 << (rest - 1).bit_length() if rest else 0)


def scores_line(split: str, figures: dict) -> str:
    """The line `python -m transformer.evaluate` (and `train.py --score_split`) prints."""
    if "accuracy" in figures:
        return (f"{split}: loss {figures['loss']:.4f} | accuracy "
                f"{100 * figures['accuracy']:.2f}%" + (
                    f" | top-5 accuracy {100 * figures['top5_accuracy']:.2f}%"
                    if "top5_accuracy" in figures else ""))
    return (f"{split}: perplexity {figures['perplexity']:.2f} | sacreBLEU "
            f"{figures['bleu']:.2f} ({figures['bleu_signature']}) | tokenized compound-split "
            f"BLEU {figures['bleu_tok_compound']:.2f} | {metrics.sentences_scored(figures)}")


def evaluate_translation(run: Run, split: str, *, num_sentences=None, beam_size=None,
                         alpha=None) -> dict:
    """Perplexity over the whole split and BLEU over its first `num_sentences` pairs, appended
    to metrics.jsonl. The sources, references and translations scored go to `<workdir>/eval/`.
    `beam_size` and `alpha` left None are the config's `decode.*`."""
    translator = from_run(run)
    cfg = run.config
    source = make_source(cfg, run.workdir)
    trainer, params = trainer_and_params(run)
    figures = evaluate(trainer, train_state.make_eval_step(trainer), params, source,
                       (0, source.eval_rows_per_batch), split)

    pairs = source.raw_pairs(split, num_sentences)
    sources = [s for s, _ in pairs]
    references = [t for _, t in pairs]
    log.info("translating %d %s sentences", len(sources), split)
    hypotheses = translator.translate(sources, beam_size=beam_size, alpha=alpha)
    figures |= scores.bleu(hypotheses, references, target_lang=cfg.data.target_lang)
    figures["bleu_num_truncated"] = translator.num_too_long(sources)

    save_texts(run.workdir, f"{split}.{run.label}", {"source": sources, "reference": references,
                                                     "translation": hypotheses})
    figures["checkpoint"] = run.label
    _append_figures(run, split, figures)
    return figures


def trainer_and_params(run: Run) -> tuple[train_state.Trainer, dict]:
    """The run's Trainer on its mesh, and its parameters placed as the Trainer shards them."""
    trainer = train_state.build_trainer(run.resolved, run.mesh)
    return trainer, jax.device_put(run.params, trainer.state_shardings.params)


def _append_figures(run: Run, split: str, figures: dict) -> None:
    """A `split` line of `figures` at the run's step in its metrics.jsonl."""
    writer = MetricWriter(run.workdir)
    writer.write(run.step, split, figures)
    writer.close()


def save_texts(workdir: str, stem: str, texts: dict[str, list[str]]) -> None:
    """`<workdir>/eval/<stem>.<kind>.txt` for each kind in `texts`, a line per sentence, in
    UTF-8 (the workdir may be remote: gs://)."""
    out_dir = epath.Path(layout.path(workdir, layout.EVAL))
    out_dir.mkdir(parents=True, exist_ok=True)
    for kind, lines in texts.items():
        (out_dir / f"{stem}.{kind}.txt").write_text("".join(line + "\n" for line in lines),
                                                     encoding="utf-8")


def _scoring_step(trainer):
    """`step(params, batch [1, B, ...]) -> (sums, confusion)`: the eval step's sums
    (`train_state.classification_figures`) and the [C, C] counts of (label, top-1 class) over the
    rows labelled >= 0, both summed over the global batch, from one pass of the model."""
    def step(params, batch):
        batch = jax.tree.map(lambda x: x[0], batch)
        logits = train_state.classifier_logits(trainer, params, batch, None)
        classes = logits.shape[-1]
        labels = batch["label"]
        truth = jax.nn.one_hot(jnp.maximum(labels, 0), classes) * (labels >= 0)[:, None]
        predicted = jax.nn.one_hot(jnp.argmax(logits, axis=-1), classes)
        confusion = jnp.einsum("BC,BK->CK", truth, predicted).astype(jnp.int32)
        return train_state.classification_figures(logits, labels), confusion

    batch_sharding = jax.NamedSharding(trainer.mesh, jax.P(None, sharding.BATCH_AXES))
    return jax.jit(step, in_shardings=(trainer.state_shardings.params, batch_sharding),
                   out_shardings=sharding.replicated(trainer.mesh))


def evaluate_split(trainer, params, source, rows: tuple[int, int],
                   split: str) -> tuple[dict, np.ndarray]:
    """(figures, confusion [C, C]) of `split` in one pass: `train_state.eval_metrics` (loss,
    accuracy, top5_accuracy) and counts of (true class, predicted class). `rows`: this
    process's rows of an eval batch (`train_state.process_rows`)."""
    scoring_step = _scoring_step(trainer)
    totals: dict[str, float] = {}
    confusion = 0
    for local in source.eval_batches(split, rows):
        sums, counts = jax.device_get(
            scoring_step(params, train_state.global_batch(trainer.mesh, local)))
        totals = {k: totals.get(k, 0.0) + float(v) for k, v in sums.items()}
        confusion = confusion + np.asarray(counts)
    return train_state.eval_metrics(totals), np.asarray(confusion, np.int64)


def evaluate_test_split(trainer, params, source, rows: tuple[int, int], step: int, writer,
                        workdir: str) -> dict:
    """Scores the source's test split: a "test" line at `step` in metrics.jsonl (via
    `writer`) and, from process 0, its confusion matrix in `<workdir>/eval/confusion_test.json`
    (train.py draws it). Returns the figures."""
    started = time.perf_counter()
    split = source.test_split
    figures, confusion = evaluate_split(trainer, params, source, rows, split)
    writer.write(step, "test", figures)
    metrics.log_evaluation(step, "test", figures, time.perf_counter() - started)
    if jax.process_index() == 0:
        save_confusion(workdir, "test", confusion, source.class_names,
                       f"{source.dataset} {split}, step {step}: top-1 accuracy "
                       f"{100 * figures['accuracy']:.2f}%")
    return figures


def confusion_files(workdir: str, split: str) -> tuple[str, str]:
    """Where a split's confusion matrix is kept, `<workdir>/eval/confusion_<split>.json`, and
    where the commands draw it, `<workdir>/plots/confusion_<split>.png`."""
    return (layout.path(workdir, layout.EVAL, f"confusion_{split}.json"),
            layout.path(workdir, layout.PLOTS, f"confusion_{split}.png"))


def save_confusion(workdir: str, split: str, counts: np.ndarray, class_names, title: str) -> str:
    """Writes the counts [C, C] of (true class, predicted class) with the class names and a
    title for the figure (`util/plotting.py`'s `plot_confusion_matrix` draws it)."""
    record = {"title": title, "class_names": list(class_names),
              "counts": np.asarray(counts).tolist()}
    path = confusion_files(workdir, split)[0]
    epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic.write_atomically(path, json.dumps(record))
    return path


def evaluate_classifier(run: Run, split: str) -> dict:
    """`python -m transformer.evaluate` for a vision run: scores `split`, appends the figures
    to metrics.jsonl and keeps the confusion matrix in `<workdir>/eval/confusion_<split>.json`
    (the command draws it)."""
    source = make_source(run.config, run.workdir)
    trainer, params = trainer_and_params(run)
    figures, confusion = evaluate_split(trainer, params, source,
                                        (0, source.eval_rows_per_batch), split)
    label = run.label if run.label.startswith("average") else f"step{run.step}"
    save_confusion(run.workdir, split, confusion, source.class_names,
                   f"{source.dataset} {split}, {label}: top-1 accuracy "
                   f"{100 * figures['accuracy']:.2f}%")
    figures["checkpoint"] = label
    _append_figures(run, split, figures)
    return figures
