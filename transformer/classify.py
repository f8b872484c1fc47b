"""Use a trained image classifier (the Vision Transformer): classify image files, and score a
split of its dataset with a confusion matrix.

    python -m transformer.classify --workdir=runs/vit_fashion_mnist shirt.png boot.jpg [--top=3]

    from transformer import classify
    classifier = classify.load("runs/vit_fashion_mnist")
    classifier.classify(["shirt.png"])  # [[("Shirt", 0.91), ("T-shirt/top", 0.05), ...]]

Files are read with Pillow (PNG, JPEG, whatever it opens), converted to the model's channels
(grey or RGB), their shorter side resized to `model.image_size` and the centre cropped as the
pipeline prepares ImageNet (`images.resize_and_crop`; an image of the model's size is left as
it is), then normalised by the per-channel mean and standard deviation of the training split
that the run recorded in config.json (provenance "images", `ImageSource.preprocessing`). With the
run's `data.test_time_flip`, an image's probabilities are the mean of its own and its mirror
image's, as in the run's evaluation.

At the end of training the loop scores the test split here (`test_evaluation`): loss, top-1 and
(more than 10 classes) top-5 accuracy on a "test" line of metrics.jsonl, and the confusion
matrix drawn to `<workdir>/plots/confusion_test.png`.

Shapes: B images, C classes, H = W = model.image_size, ch channels.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
import time

import numpy as np

from transformer.checkpoint import workdir as workdir_lib
from transformer.util import cli

log = logging.getLogger("transformer")
MODES = {1: "L", 3: "RGB"}  # Pillow's mode for the model's channel count


# --------------------------------------------------------------------------- scoring a split


def _scoring_step(trainer):
    """`step(params, batch [1, B, ...]) -> (sums, confusion)`: the eval step's sums
    (`step_lib.classification_figures`) and the [C, C] counts of (label, top-1 class) over the
    rows labelled >= 0, both summed over the global batch, from one pass of the model."""
    import jax
    import jax.numpy as jnp

    from transformer.training import sharding
    from transformer.training import step as step_lib

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
    import jax

    from transformer.training import step as step_lib

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
    fraction of each true class, with the counts written in (up to 20 classes)."""
    from transformer.visualize import pyplot

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
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def test_evaluation(trainer, params, source, rows: tuple[int, int], step: int, writer,
                    workdir: str) -> dict:
    """Scores the source's test split: a "test" line at `step` in metrics.jsonl (via
    `writer`) and `<workdir>/plots/confusion_test.png` (process 0). Returns the figures."""
    import jax

    from transformer.training import metrics

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


def evaluate_workdir(workdir: str, split: str, *, step: int | None = None,
                     average: int | None = None) -> dict:
    """`python -m transformer.evaluate` for a vision run: scores `split` with the checkpoint
    `step` (default the latest; or the average of the last `average`), appends the figures to
    metrics.jsonl and draws `<workdir>/plots/confusion_<split>.png`."""
    import jax

    from transformer.checkpoint.averaging import load_params, params_step
    from transformer.config import Resolved, resolve
    from transformer.data import make_source
    from transformer.training import sharding
    from transformer.training import step as step_lib
    from transformer.training.metrics import MetricWriter

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


# --------------------------------------------------------------------------- classifying files


def read_image(path: str, image_size: int, num_channels: int) -> np.ndarray:
    """The file at `path` as uint8 [H, W, ch]: the model's channels, its size (shorter side
    resized, centre cropped). One-line ValueError when it is no image Pillow reads."""
    from PIL import Image, UnidentifiedImageError

    from transformer.data.images import resize_and_crop

    if not os.path.isfile(path):
        raise ValueError(f"{path}: {'a directory' if os.path.isdir(path) else 'no such file'}; "
                         f"give image files (PNG, JPEG)")
    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert(MODES[num_channels]), np.uint8)
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        kind = "not an image" if isinstance(error, UnidentifiedImageError) else "damaged"
        raise ValueError(f"{path} is {kind} (Pillow cannot read it): give image files (PNG, "
                         f"JPEG)") from None
    pixels = pixels.reshape(*pixels.shape[:2], num_channels)
    if pixels.shape[:2] == (image_size, image_size):
        return pixels
    return resize_and_crop(pixels, image_size)


@dataclasses.dataclass
class Classifier:
    """A trained Vision Transformer, its parameters and the preprocessing it was trained with."""

    model_config: object  # TransformerConfig of architecture "vision"
    params: dict
    class_names: tuple[str, ...]
    mean: np.ndarray  # [ch], in [0, 1] pixel units
    std: np.ndarray  # [ch]
    test_time_flip: bool = False  # average each image's probabilities with its mirror's

    def normalise(self, images: np.ndarray) -> np.ndarray:
        """uint8 [B, H, W, ch] -> float32 (x / 255 - mean) / std, as in training."""
        return ((images.astype(np.float32) / 255.0 - self.mean) / self.std).astype(np.float32)

    @functools.cached_property
    def _probabilities(self):
        import jax

        from transformer.model.vit import VisionTransformer, mirror_averaged_logits

        model = VisionTransformer(self.model_config)

        def probabilities(params, images):
            def logits_fn(x):
                return model.apply({"params": params}, x)

            logits = (mirror_averaged_logits(logits_fn, images) if self.test_time_flip
                      else logits_fn(images))
            return jax.nn.softmax(logits, axis=-1)

        return jax.jit(probabilities)

    def probabilities(self, images: list[str] | np.ndarray) -> np.ndarray:
        """Class probabilities [B, C] of image files, or of uint8 images [B, H, W, ch]."""
        if not isinstance(images, np.ndarray):
            cfg = self.model_config
            images = np.stack([read_image(p, cfg.image_size, cfg.num_channels) for p in images])
        return np.asarray(self._probabilities(self.params, self.normalise(images)))

    def classify(self, images: list[str] | np.ndarray,
                 top: int = 5) -> list[list[tuple[str, float]]]:
        """The `top` most probable classes of each image, (name, probability), most probable
        first."""
        probabilities = self.probabilities(images)
        order = np.argsort(-probabilities, axis=-1, kind="stable")[:, :top]
        return [[(self.class_names[c], float(p[c])) for c in row]
                for p, row in zip(probabilities, order, strict=True)]


def load(workdir: str, *, step: int | None = None) -> Classifier:
    """The classifier of a trained vision run's workdir (checkpoint `step`, or the latest)."""
    from transformer.checkpoint import averaging
    from transformer.config import resolve

    run = resolve(workdir_lib.load_config(workdir))
    if run.model.architecture != "vision":
        raise ValueError(f"{workdir} holds a {run.model.architecture} model, not an image "
                         f"classifier (model.architecture='vision'): use python -m "
                         f"transformer.translate or transformer.generate for it")
    recorded = (workdir_lib.read_config_file(workdir) or {}).get("provenance", {}).get("images")
    if not recorded:
        raise ValueError(f"{workdir_lib.path(workdir, workdir_lib.CONFIG)} records no image "
                         f"preprocessing (provenance.images: classes, mean, std); it was "
                         f"written by an older version: train the run again")
    params = averaging.load_params(workdir, step=step)
    return Classifier(run.model, params, tuple(recorded["class_names"]),
                      np.asarray(recorded["mean"], np.float32),
                      np.asarray(recorded["std"], np.float32),
                      test_time_flip=bool(run.config.data.get("test_time_flip")))


# --------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    """argparse reporting a bad command line as one line with exit status 1."""

    def error(self, message: str):
        sys.exit(f"error: {self.prog}: {message} (--help lists the flags)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m transformer.classify",
                     description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="a trained vision run's workdir")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--top", type=int, default=5, help="classes shown per image")
    parser.add_argument("images", nargs="+", help="image files (PNG, JPEG, ...)")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top={args.top} must be >= 1")
    return args


def format_results(paths: list[str], results: list[list[tuple[str, float]]]) -> str:
    """One line per image: the path, then `class probability%` for its top classes."""
    return "\n".join(f"{path}: " + ", ".join(f"{name} {100 * p:.1f}%" for name, p in classes)
                     for path, classes in zip(paths, results, strict=True))


def main(argv: list[str]) -> None:
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's INFO chatter
    cli.quiet_native_logs(["python -m transformer.classify", *argv])
    args = parse_args(argv)
    with cli.one_line_errors():
        classifier = load(args.workdir, step=args.step)
        cfg = classifier.model_config
        images = np.stack([read_image(p, cfg.image_size, cfg.num_channels)
                           for p in args.images])  # every file checked before the model runs
        results = classifier.classify(images, top=min(args.top, len(classifier.class_names)))
    print(format_results(args.images, results))


if __name__ == "__main__":
    main(sys.argv[1:])
