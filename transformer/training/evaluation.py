"""Scoring a split: perplexity over a source's eval batches (the loop's validation), a
translation run's test figures (perplexity and both BLEUs, like the paper's Table 2: what
`python -m transformer.evaluate` prints), and an image classifier's loss, accuracy, top-5 accuracy
and confusion matrix.

Shapes: B rows, C classes.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from transformer.checkpoint import workdir as workdir_lib
from transformer.checkpoint.averaging import load_params, params_step
from transformer.config import Resolved, resolve
from transformer.data import make_source
from transformer.inference.translator import load
from transformer.parallel import sharding
from transformer.training import metrics, scores
from transformer.training import step as step_lib
from transformer.training.metrics import MetricWriter
from transformer.util import progress
from transformer.util.plotting import pyplot, save

log = logging.getLogger("transformer")


def evaluate(trainer, eval_step, params, source, rows, split="validation") -> dict:
    """Unsmoothed eval loss and perplexity (a classifier: loss and accuracy,
    `step_lib.eval_metrics`) over the source's eval batches of `split` (progress on stderr
    from process 0)."""
    totals = {"nll_sum": 0.0, "tokens": 0.0}
    with progress.bar(None, f"evaluating on {split}", unit="batch",
                      show=jax.process_index() == 0) as bar:
        for local in source.eval_batches(split, rows):
            sums = jax.device_get(eval_step(params, step_lib.global_batch(trainer.mesh, local)))
            totals = {k: totals.get(k, 0.0) + float(v) for k, v in sums.items()}
            bar.update()
    return step_lib.eval_metrics(totals)


def evaluate_run(workdir: str, split: str, *, step=None, average=None, num_sentences=None,
                 beam_size=None) -> dict:
    """What `python -m transformer.evaluate` scores: a translation run's perplexity and BLEU
    (`evaluate_translation`), or an image classifier's figures (`evaluate_classifier`)."""
    if workdir_lib.load_config(workdir).model.get("architecture") == "vision":
        return evaluate_classifier(workdir, split, step=step, average=average)
    return evaluate_translation(workdir, split, step=step, average=average,
                                num_sentences=num_sentences, beam_size=beam_size)


def evaluate_translation(workdir: str, split: str, *, step=None, average=None,
                         num_sentences=None, beam_size=None) -> dict:
    """Perplexity over the whole split and BLEU over its first `num_sentences` pairs, appended
    to metrics.jsonl; the sources, references and translations scored go to `<workdir>/eval/`."""
    translator = load(workdir, step=step, average=average)
    cfg = translator.config
    source = make_source(cfg, workdir)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    trainer = step_lib.build_trainer(Resolved(cfg, translator.model_config, dict(mesh.shape)),
                                      mesh)
    params = jax.device_put(translator.params, trainer.state_shardings.params)
    figures = evaluate(trainer, step_lib.make_eval_step(trainer), params, source,
                       (0, source.eval_rows_per_batch), split)

    pairs = source.raw_pairs(split, num_sentences)
    sources, references = [s for s, _ in pairs], [t for _, t in pairs]
    log.info("translating %d %s sentences", len(sources), split)
    hypotheses = translator.translate(sources, beam_size=beam_size)
    figures |= scores.bleu(hypotheses, references, target_lang=cfg.data.target_lang)
    figures["bleu_num_truncated"] = translator.num_too_long(sources)

    label = f"average{average}" if average else f"step{step}" if step else "latest"
    save_texts(workdir, f"{split}.{label}", {"source": sources, "reference": references,
                                              "translation": hypotheses})
    at_step = params_step(workdir, step=step, average=average)  # the params scored
    figures["checkpoint"] = label
    writer = MetricWriter(workdir)
    writer.write(at_step, split, figures)
    writer.close()
    return figures


def save_texts(workdir: str, stem: str, texts: dict[str, list[str]]) -> None:
    """`<workdir>/eval/<stem>.<kind>.txt` for each kind in `texts`, a line per sentence, in
    UTF-8 (the workdir may be remote: gs://)."""
    out_dir = epath.Path(workdir_lib.path(workdir, workdir_lib.EVAL))
    out_dir.mkdir(parents=True, exist_ok=True)
    for kind, lines in texts.items():
        (out_dir / f"{stem}.{kind}.txt").write_text("".join(line + "\n" for line in lines),
                                                     encoding="utf-8")


def _scoring_step(trainer):
    """`step(params, batch [1, B, ...]) -> (sums, confusion)`: the eval step's sums
    (`step_lib.classification_figures`) and the [C, C] counts of (label, top-1 class) over the
    rows labelled >= 0, both summed over the global batch, from one pass of the model."""
    def step(params, batch):
        batch = jax.tree.map(lambda x: x[0], batch)
        logits = step_lib.classifier_logits(trainer, params, batch, None)
        classes = logits.shape[-1]
        labels = batch["label"]
        truth = jax.nn.one_hot(jnp.maximum(labels, 0), classes) * (labels >= 0)[:, None]
        predicted = jax.nn.one_hot(jnp.argmax(logits, axis=-1), classes)
        confusion = jnp.einsum("BC,BK->CK", truth, predicted).astype(jnp.int32)
        return step_lib.classification_figures(logits, labels), confusion

    batch_sharding = jax.NamedSharding(trainer.mesh, jax.P(None, sharding.BATCH_AXES))
    return jax.jit(step, in_shardings=(trainer.state_shardings.params, batch_sharding),
                   out_shardings=sharding.replicated(trainer.mesh))


def evaluate_split(trainer, params, source, rows: tuple[int, int],
                   split: str) -> tuple[dict, np.ndarray]:
    """(figures, confusion [C, C]) of `split` in one pass: `step_lib.eval_metrics` (loss,
    accuracy, top5_accuracy) and counts of (true class, predicted class). `rows`: this
    process's rows of an eval batch (`step_lib.process_rows`)."""
    scoring_step = _scoring_step(trainer)
    totals: dict[str, float] = {}
    confusion = 0
    for local in source.eval_batches(split, rows):
        sums, counts = jax.device_get(
            scoring_step(params, step_lib.global_batch(trainer.mesh, local)))
        totals = {k: totals.get(k, 0.0) + float(v) for k, v in sums.items()}
        confusion = confusion + np.asarray(counts)
    return step_lib.eval_metrics(totals), np.asarray(confusion, np.int64)


def plot_confusion_matrix(confusion: np.ndarray, class_names, path: str, title: str) -> str:
    """A heatmap of `confusion` [C, C] (rows: true class, columns: predicted), coloured by the
    fraction of each true class, with the counts written in (up to 20 classes). A PNG at
    `path`, local or remote (gs://: through etils.epath)."""
    plt = pyplot()
    classes = len(class_names)
    fractions = confusion / np.maximum(confusion.sum(1, keepdims=True), 1)
    size = max(5.0, 0.5 * classes + 2.0) if classes <= 40 else 12.0
    fig, ax = plt.subplots(figsize=(size, size))
    image = ax.imshow(fractions, cmap="Blues", vmin=0.0, vmax=1.0)
    if classes <= 40:
        ax.set_xticks(range(classes), class_names, rotation=90)
        ax.set_yticks(range(classes), class_names)
    if classes <= 20:
        for i in range(classes):
            for j in range(classes):
                ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if fractions[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.046, label="fraction of the true class")
    fig.tight_layout()
    return save(fig, path)


def evaluate_test_split(trainer, params, source, rows: tuple[int, int], step: int, writer,
                    workdir: str) -> dict:
    """Scores the source's test split: a "test" line at `step` in metrics.jsonl (via
    `writer`) and `<workdir>/plots/confusion_test.png` (process 0). Returns the figures."""
    started = time.perf_counter()
    split = source.test_split
    figures, confusion = evaluate_split(trainer, params, source, rows, split)
    writer.write(step, "test", figures)
    metrics.log_evaluation(step, "test", figures, time.perf_counter() - started)
    if jax.process_index() == 0:
        plot_confusion_matrix(confusion, source.class_names,
                              workdir_lib.path(workdir, workdir_lib.PLOTS, "confusion_test.png"),
                              f"{source.dataset} {split}, step {step}: top-1 accuracy "
                              f"{100 * figures['accuracy']:.2f}%")
    return figures


def evaluate_classifier(workdir: str, split: str, *, step: int | None = None,
                        average: int | None = None) -> dict:
    """`python -m transformer.evaluate` for a vision run: scores `split` with the checkpoint
    `step` (default the latest; or the average of the last `average`), appends the figures to
    metrics.jsonl and draws `<workdir>/plots/confusion_<split>.png`."""
    run = resolve(workdir_lib.load_config(workdir))
    params = load_params(workdir, step=step, average=average)
    source = make_source(run.config, workdir)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    trainer = step_lib.build_trainer(Resolved(run.config, run.model, dict(mesh.shape)), mesh)
    params = jax.device_put(params, trainer.state_shardings.params)
    figures, confusion = evaluate_split(trainer, params, source,
                                        (0, source.eval_rows_per_batch), split)
    at_step = params_step(workdir, step=step, average=average)
    label = f"average{average}" if average else f"step{at_step}"
    plot_confusion_matrix(confusion, source.class_names,
                          workdir_lib.path(workdir, workdir_lib.PLOTS, f"confusion_{split}.png"),
                          f"{source.dataset} {split}, {label}: top-1 accuracy "
                          f"{100 * figures['accuracy']:.2f}%")
    figures["checkpoint"] = label
    writer = MetricWriter(workdir)
    writer.write(at_step, split, figures)
    writer.close()
    return figures
