"""Classify image files with a trained image classifier (the Vision Transformer); the library
is `transformer.inference.classifier` (scoring a split: `python -m transformer.evaluate`).

    python -m transformer.classify --workdir=runs/vit_fashion_mnist shirt.png boot.jpg [--top=3]

Prints one line per image: its path, then `class probability%` for its top classes. How a file
is read, resized and normalised as in training: `transformer.inference.classifier`.
"""

from __future__ import annotations

import argparse
import logging
import sys

import numpy as np

from transformer.util import cli

log = logging.getLogger("transformer")




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
        from transformer.inference.classifier import load, read_image

        classifier = load(args.workdir, step=args.step)
        cfg = classifier.model_config
        images = np.stack([read_image(p, cfg.image_size, cfg.num_channels)
                           for p in args.images])  # every file checked before the model runs
        results = classifier.classify(images, top=min(args.top, len(classifier.class_names)))
    print(format_results(args.images, results))


if __name__ == "__main__":
    main(sys.argv[1:])
