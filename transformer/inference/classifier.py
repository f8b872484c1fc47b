"""A trained image classifier (the Vision Transformer) from Python: classify image files.

    import transformer
    classifier = transformer.load_classifier("runs/vit_fashion_mnist")
    classifier.classify(["shirt.png"])  # [[("Shirt", 0.91), ("T-shirt/top", 0.05), ...]]

Files are read with Pillow (PNG, JPEG, whatever it opens), converted to the model's channels
(grey or RGB), their shorter side resized to `model.image_size` and the centre cropped as the
pipeline prepares ImageNet (`images.resize_and_crop`; an image of the model's size is left as
it is), then normalised by the per-channel mean and standard deviation of the training split
that the run recorded in config.json (provenance "images", `ImageSource.preprocessing`). With the
run's `data.test_time_flip`, an image's probabilities are the mean of its own and its mirror
image's, as in the run's evaluation.

Shapes: B images, C classes, H = W = model.image_size, ch channels.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from transformer.checkpoint import layout

MODES = {1: "L", 3: "RGB"}  # Pillow's mode for the model's channel count


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
    from transformer.inference.runs import open_run

    def require_vision(model) -> None:
        if model.architecture != "vision":
            raise ValueError(f"{workdir} holds a {model.architecture} model, not an image "
                             f"classifier (model.architecture='vision'): use python -m "
                             f"transformer.translate or transformer.generate for it")

    run = open_run(workdir, step=step, vocabulary="none", check=require_vision)
    recorded = run.provenance.get("images")
    if not recorded:
        raise ValueError(f"{layout.path(workdir, layout.CONFIG)} records no image "
                         f"preprocessing (provenance.images: classes, mean, std); it was "
                         f"written by an older version: train the run again")
    return Classifier(run.model, run.params, tuple(recorded["class_names"]),
                      np.asarray(recorded["mean"], np.float32),
                      np.asarray(recorded["std"], np.float32),
                      test_time_flip=bool(run.config.data.get("test_time_flip")))
