"""Training an image classifier: the classification loss and accuracy sums against numpy, and a
tiny ViT trained through `train_and_evaluate` on the committed Fashion-MNIST fixture."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformer.training import evaluation, loop, train_state


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
    sums, correct, top5 = train_state.classification_sums(
        jnp.asarray(logits), jnp.asarray(labels), label_smoothing=eps)
    loss, want_correct, want_top5 = _numpy_sums(logits.astype(np.float64), labels, eps)
    np.testing.assert_allclose(float(sums.loss_sum), loss, rtol=1e-5)
    assert float(sums.weight_sum) == 5.0
    assert (float(correct), float(top5)) == (want_correct, want_top5)
    assert 0 < want_correct < want_top5 < 5  # the case separates top-1 from top-5


def test_eval_metrics_of_classification_sums():
    figures = train_state.eval_metrics({"nll_sum": 6.0, "tokens": 4.0, "correct": 3.0})
    assert figures == {"loss": 1.5, "accuracy": 0.75}
    figures = train_state.eval_metrics({"nll_sum": 6.0, "tokens": 4.0, "correct": 3.0,
                                        "top5_correct": 4.0})
    assert figures["top5_accuracy"] == 1.0


@pytest.fixture(scope="module")
def data_dir(offline_data_dir):
    return offline_data_dir("offline_fashion_mnist")


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
    first = np.mean([m["loss"] for m in train[:5]])
    last = np.mean([m["loss"] for m in train[-5:]])
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
    (test,) = [m for m in lines if m["split"] == "test"]  # scored once, after the last update
    assert test["step"] == 40 and set(test) == {"step", "split", "loss", "accuracy"}
    test_size = tfds.builder("offline_fashion_mnist", data_dir=str(data_dir)).info.splits[
        "test"].num_examples
    assert test["accuracy"] * test_size == pytest.approx(round(test["accuracy"] * test_size),
                                                         abs=1e-6)
    counts = json.loads((tmp_path / "eval" / "confusion_test.json").read_text())["counts"]
    assert round(test["accuracy"] * test_size) == np.trace(counts)  # the loop keeps the matrix
    recorded = json.loads((tmp_path / "config.json").read_text())["provenance"]["images"]
    assert recorded["class_names"][0] == "T-shirt/top" and len(recorded["mean"]) == 1
    # `python -m transformer.evaluate` on one device scores the final checkpoint alike
    (tmp_path / "eval" / "confusion_test.json").unlink()
    again = evaluation.evaluate_run(str(tmp_path), "test")
    assert again["accuracy"] == pytest.approx(test["accuracy"], abs=1e-9)
    assert again["loss"] == pytest.approx(test["loss"], rel=1e-4)
    assert json.loads((tmp_path / "eval" / "confusion_test.json").read_text())["counts"] == counts


@pytest.mark.slow
def test_image_run_resumes_exactly_and_two_processes_match_one(data_dir, tmp_path):
    """train.py on the fixture: a run killed right after its step-3 checkpoint and resumed logs
    the uninterrupted run's losses bit for bit (same mesh and processes); 2 processes x 4
    devices give its train, validation and test losses to float32 rounding."""
    from test_multihost import figures, finish, launch

    shrink = {"data.data_dir": data_dir, "model.num_encoder_layers": 1, "model.d_model": 16,
              "model.d_ff": 32, "model.num_heads": 2, "data.batch_size": 16,
              "data.eval_batch_size": 64, "num_train_steps": 6, "log_every_steps": 1,
              "eval_every_steps": 6, "checkpoint_every_steps": 3,
              "checkpoint_every_minutes": 0, "optimizer.warmup_steps": 2}
    overrides = ["--config=configs/vit_fashion_mnist.py",
                 *(f"--config.{key}={value}" for key, value in shrink.items())]
    finish(launch(tmp_path / "one", processes=1, devices=8, overrides=overrides, common=()))
    reference = figures(tmp_path / "one")
    assert set(reference) == {(s, "train") for s in range(1, 7)} | {(6, "test"),
                                                                     (6, "validation")}

    killed = launch(tmp_path / "resumed", processes=1, devices=8, overrides=overrides,
                    common=(), faults={0: "killafter@3"})
    killed[0].wait(timeout=600)
    # killed once step 3's (asynchronous) save completed: the steps logged after it are redone
    assert killed[0].returncode == -9
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()) == ["3"]
    finish(launch(tmp_path / "resumed", processes=1, devices=8, overrides=overrides, common=()))
    assert figures(tmp_path / "resumed") == reference  # bit for bit

    finish(launch(tmp_path / "two", processes=2, devices=4, overrides=overrides, common=()))
    two = figures(tmp_path / "two")
    assert sorted(two) == sorted(reference)
    np.testing.assert_allclose([two[k] for k in sorted(two)],
                               [reference[k] for k in sorted(reference)], rtol=1e-5)
    assert (tmp_path / "two" / "plots" / "confusion_test.png").exists()


def test_compile_only_plans_an_image_batch(load_config):
    """`--compile_only`'s plan of a tiny ViT on 8 devices: a float32 image batch [A, rows, 28,
    28, 1] and int32 labels; activations counted over 17 tokens, logits one row of 10 per
    image (encoder layers by `activation_bytes`' formula, remat none, float32)."""
    import jax

    from transformer.config import resolve
    from transformer.sizing import batches
    from transformer.sizing.report import compile_report

    cfg = load_config("vit_fashion_mnist.py", **{
        "model.num_encoder_layers": 1, "model.d_model": 16, "model.d_ff": 32,
        "model.num_heads": 2, "data.batch_size": 32, "grad_accum_steps": 2})
    run = resolve(cfg, 8)
    assert batches.batch_shapes(run.config) == {"image": (2, 16, 28, 28, 1), "label": (2, 16)}
    report = compile_report(run, 8)
    assert "32 rows per update = 2 microbatch(es) x 16 rows (2 per device), images 28x28x1 " \
           "as 17 tokens" in report
    figures = dict(item.split("=") for item in report.splitlines()[-1].split()[1:])
    # per image: q, k, v, A.V (4 x 17 x 16), input, out-proj, residual, norm (4 x 17 x 16),
    # weights 2 x 17 x 17; FFN 17 x (2 x 32 + 3 x 16); the layer input 17 x 16; the embedded
    # tokens 17 x 16; two float32 copies of 10 logits
    per_image = (8 * 17 * 16 + 2 * 17 * 17 + 17 * (2 * 32 + 3 * 16) + 17 * 16 + 17 * 16
                 + 2 * 10) * 4
    assert int(figures["analytic_activations"]) == 2 * per_image  # 2 images per device
    batch = 2 * 2 * 28 * 28 * 4 + 2 * 2 * 4  # one device's rows of both microbatches
    assert int(figures["analytic_batch"]) == batch
    assert jax.device_count() == 8
