"""Classify image files with a trained image classifier (the Vision Transformer). The library
is `transformer.inference.classifier` (scoring a split: `python -m transformer.evaluate`).

    python -m transformer.classify --workdir=runs/vit_fashion_mnist shirt.png boot.jpg [--top=3]

Prints one line per image: its path, then `class probability%` for its top classes. How a file
is read, resized and normalised as in training: `transformer.inference.classifier`.
"""

from __future__ import annotations

import logging

import numpy as np
from absl import app, flags

from transformer.util import cli

log = logging.getLogger("transformer")

cli.define_run_flags(average=False)
flags.DEFINE_integer("top", 5, "Classes shown per image.", lower_bound=1)
FLAGS = flags.FLAGS


def format_results(paths: list[str], results: list[list[tuple[str, float]]]) -> str:
    """One line per image: the path, then `class probability%` for its top classes."""
    return "\n".join(f"{path}: " + ", ".join(f"{name} {100 * p:.1f}%" for name, p in classes)
                     for path, classes in zip(paths, results, strict=True))


def main(argv: list[str]) -> None:
    paths = argv[1:]
    if not paths:
        cli.usage_error("give one or more image files (PNG, JPEG, ...)")
    cli.start(argv[:1])
    with cli.one_line_errors():
        from transformer.inference.classifier import load, read_image

        classifier = load(FLAGS.workdir, step=FLAGS.step)
        cfg = classifier.model_config
        images = np.stack([read_image(p, cfg.image_size, cfg.num_channels)
                           for p in paths])  # every file checked before the model runs
        results = classifier.classify(images, top=min(FLAGS.top, len(classifier.class_names)))
    print(format_results(paths, results))


if __name__ == "__main__":
    app.run(main)
