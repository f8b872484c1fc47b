"""Training an image classifier: the classification loss and accuracy sums against numpy, and a
tiny ViT trained through `train_and_evaluate` on the committed Fashion-MNIST fixture."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformer import loop, train_lib
from transformer.data import offline_fashion_mnist as ofm

FIXTURE = pathlib.Path(__file__).parent / "data" / "offline_fashion_mnist"


def _numpy_sums(logits, labels, eps):
    """Smoothed cross-entropy, top-1 and top-5 hits over rows with label >= 0 (ties ranked by
    lower class index, as `jax.lax.top_k`)."""
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    loss = correct = top5 = 0.0
    for row, label in zip(log_p, labels, strict=True):
        if label < 0:
            continue
        q = np.full(row.shape, eps / row.size)
        q[label] += 1 - eps
        loss += -(q * row).sum()
        order = sorted(range(row.size), key=lambda c: (-row[c], c))
        correct += order[0] == label
        top5 += label in order[:5]
    return loss, correct, top5


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_classification_sums_against_numpy(eps):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 12)).astype(np.float32)
    logits[3] = 0.0  # uniform row: class 0 ranks first
    labels = np.array([4, -1, 0, 0, 11, 7], np.int32)
    sums, correct, top5 = train_lib.classification_sums(
        jnp.asarray(logits), jnp.asarray(labels), label_smoothing=eps)
    loss, want_correct, want_top5 = _numpy_sums(logits.astype(np.float64), labels, eps)
    np.testing.assert_allclose(float(sums.loss_sum), loss, rtol=1e-5)
    assert float(sums.weight_sum) == 5.0
    assert (float(correct), float(top5)) == (want_correct, want_top5)
    assert 0 < want_correct < want_top5 < 5  # the case separates top-1 from top-5


def test_eval_metrics_of_classification_sums():
    figures = train_lib.eval_metrics({"nll_sum": 6.0, "tokens": 4.0, "correct": 3.0})
    assert figures == {"loss": 1.5, "accuracy": 0.75}
    figures = train_lib.eval_metrics({"nll_sum": 6.0, "tokens": 4.0, "correct": 3.0,
                                      "top5_correct": 4.0})
    assert figures["top5_accuracy"] == 1.0


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A TFDS data_dir holding offline_fashion_mnist built from the fixture (no apt)."""
    path = tmp_path_factory.mktemp("fashion_tfds")
    ofm.OfflineFashionMnist(data_dir=str(path)).download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(manual_dir=str(FIXTURE)))
    return path


def test_tiny_vit_trains_through_the_loop(load_config, data_dir, tmp_path):
    """40 updates of a 2-layer ViT over 8 devices (data 4 x fsdp 2, 2 microbatches): the train
    loss falls and the validation line carries loss and accuracy."""
    cfg = load_config("vit_fashion_mnist.py", **{
        "model.num_encoder_layers": 2, "model.d_model": 32, "model.d_ff": 64,
        "model.num_heads": 2, "data.data_dir": str(data_dir), "data.batch_size": 32,
        "data.eval_batch_size": 32, "grad_accum_steps": 2, "num_train_steps": 40,
        "log_every_steps": 10, "eval_every_steps": 40, "checkpoint_every_steps": 0,
        "checkpoint_every_minutes": 0, "mesh.data": 4, "mesh.fsdp": 2,
        "optimizer.warmup_steps": 5, "optimizer.learning_rate": 5e-3})
    loop.train_and_evaluate(cfg, str(tmp_path))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["split"] == "train"]
    assert len(train) == 40
    first, last = np.mean([m["loss"] for m in train[:5]]), np.mean([m["loss"] for m in train[-5:]])
    assert first == pytest.approx(np.log(10), rel=0.05)  # zero-initialised head: uniform
    assert last < first - 0.1
    assert all(m["target_tokens_per_update"] == 32 for m in train)  # images, not tokens
    (validation,) = [m for m in lines if m["split"] == "validation"]
    assert validation["step"] == 40
    assert 0.0 <= validation["accuracy"] <= 1.0
    # a fraction of the split's images: the padding rows of the last eval batch are not counted
    size = tfds.builder("offline_fashion_mnist", data_dir=str(data_dir)).info.splits[
        "validation"].num_examples
    assert size % 32 and validation["accuracy"] * size == pytest.approx(
        round(validation["accuracy"] * size), abs=1e-6)
    assert validation["accuracy"] > 0.1  # chance
    assert "perplexity" not in validation and "top5_accuracy" not in validation
