"""`transformer.classify`: image files through Pillow, normalised as in training, against the
model applied by hand; the CLI on good and bad files; the confusion matrix of a split."""

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import VISION_CLASSES, VISION_MEAN, VISION_STD
from PIL import Image

import transformer
from transformer.config import resolve
from transformer.inference.classifier import read_image
from transformer.model.vit import VisionTransformer
from transformer.parallel import sharding
from transformer.training import evaluation, train_state
from transformer.util import plotting

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLASSES = VISION_CLASSES
MEAN = VISION_MEAN
STD = VISION_STD



def _by_hand(workdir, pixels: np.ndarray) -> np.ndarray:
    """Softmax of the model on uint8 [B, 28, 28, 1] normalised with the recorded statistics."""
    classifier = transformer.load_classifier(str(workdir))
    images = ((pixels / 255.0 - MEAN) / STD).astype(np.float32)
    logits = VisionTransformer(classifier.model_config).apply(
        {"params": classifier.params}, images)
    return np.asarray(jax.nn.softmax(logits, axis=-1))


def test_png_and_jpeg_files_match_the_model_applied_by_hand(untrained_vision_workdir, tmp_path):
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (28, 28), dtype=np.uint8)
    Image.fromarray(grey).save(tmp_path / "a.png")
    colour = rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)
    Image.fromarray(colour).save(tmp_path / "b.jpg", quality=95)
    classifier = transformer.load_classifier(str(untrained_vision_workdir))
    # the JPEG as Pillow decodes it, to grey by Pillow's "L" conversion
    decoded = np.asarray(Image.open(tmp_path / "b.jpg").convert("L"))
    want = _by_hand(untrained_vision_workdir, np.stack([grey, decoded])[..., None])
    got = classifier.probabilities([str(tmp_path / "a.png"), str(tmp_path / "b.jpg")])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(want[0] - want[1]).max() > 1e-3  # the two images are told apart
    top = classifier.classify([str(tmp_path / "a.png")], top=3)[0]
    order = np.argsort(-want[0])[:3]
    assert [name for name, _ in top] == [CLASSES[c] for c in order]
    np.testing.assert_allclose([p for _, p in top], want[0][order], rtol=1e-5)


def test_a_run_evaluated_with_the_mirror_classifies_with_it(untrained_vision_workdir, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(untrained_vision_workdir, workdir)
    config = json.loads((workdir / "config.json").read_text())
    config["data"]["test_time_flip"] = True
    (workdir / "config.json").write_text(json.dumps(config))
    pixels = np.random.default_rng(5).integers(0, 256, (3, 28, 28, 1), dtype=np.uint8)
    want = (_by_hand(workdir, pixels) + _by_hand(workdir, pixels[:, :, ::-1])) / 2
    got = transformer.load_classifier(str(workdir)).probabilities(pixels)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(got - _by_hand(workdir, pixels)).max() > 1e-4  # the mirror changed them


def test_a_larger_image_is_resized_then_centre_cropped(untrained_vision_workdir, tmp_path):
    """A 56x84 image: shorter side to 28 (Pillow bilinear), centre 28x28 of the 28x42."""
    rng = np.random.default_rng(1)
    big = rng.integers(0, 256, (56, 84), dtype=np.uint8)
    Image.fromarray(big).save(tmp_path / "big.png")
    pixels = read_image(str(tmp_path / "big.png"), 28, 1)
    resized = np.asarray(Image.fromarray(big).resize((42, 28), Image.BILINEAR))
    np.testing.assert_array_equal(pixels[..., 0], resized[:, 7:35])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "transformer.classify", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_cli_prints_the_top_classes(untrained_vision_workdir, tmp_path):
    image = np.random.default_rng(2).integers(0, 256, (28, 28), dtype=np.uint8)
    Image.fromarray(image).save(tmp_path / "x.png")
    result = _cli(f"--workdir={untrained_vision_workdir}", "--top=2", tmp_path / "x.png")
    assert result.returncode == 0, result.stderr
    want = _by_hand(untrained_vision_workdir, image[None, ..., None])[0]
    first, second = np.argsort(-want)[:2]
    assert result.stdout.strip() == (f"{tmp_path / 'x.png'}: {CLASSES[first]} "
                                     f"{100 * want[first]:.1f}%, {CLASSES[second]} "
                                     f"{100 * want[second]:.1f}%")


@pytest.mark.parametrize("case", ["not_an_image", "missing", "text_run"])
def test_cli_bad_input_is_one_line(case, untrained_vision_workdir, untrained_translation_workdir,
                                   tmp_path):
    good = tmp_path / "good.png"
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(good)
    workdir = untrained_vision_workdir
    files = [good]
    expected = ""
    if case == "not_an_image":
        (tmp_path / "notes.png").write_text("not pixels")
        files = [good, tmp_path / "notes.png"]
        expected = "notes.png is not an image"
    elif case == "missing":
        files = [tmp_path / "nope.jpg"]
        expected = "nope.jpg: no such file"
    else:
        workdir = untrained_translation_workdir
        expected = "not an image classifier"
    result = _cli(f"--workdir={workdir}", *files)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


class _Batches:
    """Two eval batches of 4 rows (the last row padding) over which the confusion is known."""

    test_split = "test"

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def eval_batches(self, split, rows):
        for first in (0, 4):
            yield {"image": self.images[None, first:first + 4],
                   "label": self.labels[None, first:first + 4]}


@pytest.mark.parametrize("test_time_flip", [False, True])
def test_confusion_matrix_counts_label_and_top1_pairs(untrained_vision_workdir, test_time_flip):
    """The split's loss, accuracy and confusion (4 devices) against the classifier's
    probabilities; with `test_time_flip`, those of each image and its mirror averaged."""
    classifier = dataclasses.replace(transformer.load_classifier(str(untrained_vision_workdir)),
                                     test_time_flip=test_time_flip)
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (8, 28, 28, 1), dtype=np.uint8)
    images = classifier.normalise(pixels)
    labels = np.array([0, 3, 3, 9, 1, 1, 5, -1], np.int32)
    cfg = json.loads((untrained_vision_workdir / "config.json").read_text())
    cfg.pop("provenance")
    from ml_collections import ConfigDict

    mesh = sharding.make_mesh({"data": 4, "fsdp": 1, "tensor": 1}, jax.devices()[:4])
    cfg["data"]["test_time_flip"] = test_time_flip
    trainer = train_state.build_trainer(resolve(ConfigDict(cfg), 4), mesh)
    params = jax.device_put(classifier.params, trainer.state_shardings.params)
    figures, confusion = evaluation.evaluate_split(trainer, params, _Batches(images, labels),
                                                 (0, 4), "test")
    probabilities = classifier.probabilities(pixels)
    if test_time_flip:
        plain, mirrored = (_by_hand(untrained_vision_workdir, x)
                           for x in (pixels, pixels[:, :, ::-1]))
        np.testing.assert_allclose(probabilities, (plain + mirrored) / 2, rtol=1e-5, atol=1e-6)
    labelled = labels >= 0
    want_loss = -np.log(probabilities[labelled, labels[labelled]]).mean()
    assert figures["loss"] == pytest.approx(want_loss, rel=1e-5)
    predicted = probabilities.argmax(-1)
    want = np.zeros((10, 10), np.int64)
    for label, guess in zip(labels, predicted, strict=True):
        if label >= 0:
            want[label, guess] += 1
    np.testing.assert_array_equal(confusion, want)
    assert figures["accuracy"] == pytest.approx(np.trace(want) / 7)
    record = evaluation.save_confusion(str(untrained_vision_workdir), "test", confusion, CLASSES,
                                       "t")
    out = plotting.plot_confusion_matrix(record, str(untrained_vision_workdir / "c.png"))
    assert (untrained_vision_workdir / "c.png").stat().st_size > 1000 and out.endswith("c.png")
