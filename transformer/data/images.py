"""Image classification batches (the `Source` contract of `transformer.data`) from TFDS: the
offline `offline_fashion_mnist`, and `fashion_mnist`, `mnist`, `cifar10`, `imagenet2012` where a
user has prepared them (read with download=False semantics: nothing is fetched).

Batches are {"image": [A, rows, H, W, C] float32, "label": [A, rows] int32} (A microbatches;
H = W = model.image_size, C = model.num_channels): pixels scaled to [0, 1], then normalised per
channel by the training split's mean and standard deviation (`ImageSource.mean`, `.std`; the
ImageNet constants for imagenet2012). Evaluation batches mark padding rows with label -1.

Order: global batch `index` is epoch e = index // batches_per_epoch of a permutation of the
training images seeded by (seed, e), cut into consecutive runs of `batch_size` (the remainder of
an epoch is dropped). Augmentation (training only): a random crop after zero-padding each side
by `data.crop_padding` pixels, and a horizontal flip with probability 1/2 when
`data.random_flip` (not for digits). The draws of the whole global batch come from a generator
seeded by (seed, index), so a batch is a pure function of (seed, index) and a process computes
only its own rows (`rows` = (start, stop) of each microbatch) yet gets exactly their share.
Evaluation batches are never augmented; `data.test_time_flip` (checked here: not for digits)
makes evaluation and `transformer.classify` average each image's class probabilities with its
mirror image's (`vit.mirror_averaged_logits`).

Splits: `offline_fashion_mnist` has train, validation and test. For `fashion_mnist`, `mnist`
and `cifar10` (train and test only) validation is carved from train by the offline builder's
rule (pixel hash below 1/12), so fashion_mnist and offline_fashion_mnist split alike.
`imagenet2012`'s test is its `validation` split (50,000 images, what papers report) and its
validation 1% of train chosen by a hash of the record index. Its images are decoded per batch,
resized (shorter side) and centre-cropped to model.image_size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import numpy as np

from transformer.data import batching
from transformer.data.datasets import (
    CHUNK,
    DataUnavailable,
    prepare_dataset,
    tensorflow,
    tfds_quietly,
)

log = logging.getLogger("transformer")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_AUGMENT = 1  # random stream of the augmentation draws


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """How a TFDS image dataset maps onto train, validation and test."""

    flip_suits: bool  # mirrored images stay in their class (not digits)
    has_validation: bool  # a "validation" split of its own to evaluate during training
    in_memory: bool = True  # small, one image shape: decoded once, held as uint8
    test_split: str = "test"


DATASETS = {
    "offline_fashion_mnist": DatasetSpec(flip_suits=True, has_validation=True),
    "fashion_mnist": DatasetSpec(flip_suits=True, has_validation=False),
    "mnist": DatasetSpec(flip_suits=False, has_validation=False),
    "cifar10": DatasetSpec(flip_suits=True, has_validation=False),
    "imagenet2012": DatasetSpec(flip_suits=True, has_validation=False, in_memory=False,
                                test_split="validation"),
}
IMAGENET_VALIDATION_FRACTION = 0.01


def _unit(data: bytes) -> float:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") / 2.0**64


def open_builder(name: str, data_dir: str | None, manual_dir: str | None):
    """The prepared TFDS builder (array_record). Only `offline_fashion_mnist` is built here
    (from Debian's package), and `imagenet2012` from a `data.manual_dir` of its archives.
    Any other dataset not prepared is one line saying how to provide it."""
    if name not in DATASETS:
        raise ValueError(f"data.dataset={name!r} is not an image dataset this source reads "
                         f"({', '.join(DATASETS)})")
    import tensorflow_datasets as tfds

    if name == "offline_fashion_mnist":
        from transformer.data.offline import fashion_mnist  # noqa: F401  (registers it)
    elif not tfds.builder(name, data_dir=data_dir).is_prepared() and not (
            name == "imagenet2012" and manual_dir):
        raise DataUnavailable(
            f"{name} is not prepared in {tfds.builder(name, data_dir=data_dir).data_dir} and "
            f"is never downloaded here: prepare it where there is internet (`tfds build {name} "
            f"--file_format=array_record`) and set data.data_dir to its data_dir"
            + (", or pass the archives in data.manual_dir" if name == "imagenet2012" else "")
            + ("; or use data.dataset='offline_fashion_mnist'" if name == "fashion_mnist"
               else ""))
    return prepare_dataset(name, data_dir, manual_dir)


PILLOW_MAX_RECORDS = 10_000  # a split's images decoded one by one by Pillow, at most


def _decode_all(builder, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Every record of a split, (images [N, H, W, C] uint8, labels [N] int64): the raw records
    read at once, parsed and decoded by TensorFlow in parallel (several times faster than one
    record at a time through the data source's Pillow decoding). A split of lossless (PNG)
    images no larger than PILLOW_MAX_RECORDS is decoded by Pillow: the same pixels, sooner than
    TensorFlow is imported (4-5 CPU s; Pillow takes ~0.4 ms an image)."""
    from tensorflow_datasets.core import decode

    feature = builder.info.features["image"]
    if (getattr(feature, "encoding_format", "png") in (None, "png")
            and builder.info.splits[split].num_examples <= PILLOW_MAX_RECORDS):
        with tfds_quietly():  # TFDS's notice that OpenCV would decode faster
            source = builder.as_data_source(split=split)
            records = source.__getitems__(list(range(len(source))))
        return (np.stack([r["image"] for r in records]).astype(np.uint8),
                np.array([r["label"] for r in records], np.int64))
    tf = tensorflow()

    source = builder.as_data_source(split=split,
                                    deserialize_method=decode.DeserializeMethod.RAW_BYTES)
    raw = source.__getitems__(list(range(len(source))))
    dataset = tf.data.Dataset.from_tensor_slices(tf.constant(raw, tf.string)).map(
        builder.info.features.deserialize_example, num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True).batch(CHUNK)
    images = []
    labels = []
    for batch in dataset.as_numpy_iterator():
        images.append(batch["image"])
        labels.append(batch["label"])
    return np.concatenate(images).astype(np.uint8), np.concatenate(labels).astype(np.int64)


def resize_and_crop(image: np.ndarray, size: int) -> np.ndarray:
    """An image [h, w, C] uint8 with its shorter side resized to `size` (bilinear, Pillow),
    then centre-cropped to [size, size, C]."""
    from PIL import Image

    h, w = image.shape[:2]
    scale = size / min(h, w)
    new = (max(size, round(w * scale)), max(size, round(h * scale)))
    squeezed = image[..., 0] if image.shape[-1] == 1 else image
    resized = np.asarray(Image.fromarray(squeezed).resize(new, Image.BILINEAR))
    top = (resized.shape[0] - size) // 2
    left = (resized.shape[1] - size) // 2
    return resized[top:top + size, left:left + size].reshape(size, size, image.shape[-1])


class _Images:
    """One split: (images [n, S, S, C] uint8, labels [n]) by position. `arrays`, the whole TFDS
    split decoded (in-memory datasets), or None to decode, resize and crop per call."""

    def __init__(self, source, indices: np.ndarray, image_size: int, arrays=None):
        self.indices, self.image_size = np.asarray(indices, np.int64), image_size
        self._source = source
        self._arrays = None if arrays is None else (arrays[0][self.indices],
                                                    arrays[1][self.indices])

    def __len__(self) -> int:
        return len(self.indices)

    def get(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is not None:
            return self._arrays[0][positions], self._arrays[1][positions]
        records = self._source.__getitems__([int(i) for i in self.indices[positions]])
        images = [resize_and_crop(np.asarray(r["image"]), self.image_size) for r in records]
        return np.stack(images), np.asarray([r["label"] for r in records], np.int64)

    def all_images(self) -> np.ndarray:
        return self._arrays[0]


def augment(images: np.ndarray, offsets: np.ndarray, flips: np.ndarray,
            padding: int) -> np.ndarray:
    """Crops of `images` [n, S, S, C] zero-padded by `padding` on each side, the crop of row i
    starting at `offsets[i]` (row, column in 0..2*padding), then mirrored where `flips[i]`."""
    n = images.shape[0]
    s = images.shape[1]
    out = images
    if padding:
        padded = np.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
        out = np.stack([padded[i, r:r + s, c:c + s] for i, (r, c) in enumerate(offsets)])
    return np.where(flips[:, None, None, None], out[:, :, ::-1], out) if n else out


class ImageSource:
    """Normalised, augmented image batches (module docstring). The `Source` contract."""

    source_length = target_length = 1  # one label per image: FLOPs count per image

    def __init__(self, dataset: str, *, image_size: int, num_channels: int, batch_size: int,
                 grad_accum_steps: int = 1, eval_batch_size: int | None = None,
                 crop_padding: int = 0, random_flip: bool = False,
                 test_time_flip: bool = False, seed: int = 0,
                 data_dir: str | None = None, manual_dir: str | None = None):
        spec = DATASETS.get(dataset)
        if spec is None:
            raise ValueError(f"data.dataset={dataset!r} is not an image dataset this source "
                             f"reads ({', '.join(DATASETS)})")
        for key, value in (("random_flip", random_flip), ("test_time_flip", test_time_flip)):
            if value and not spec.flip_suits:
                raise ValueError(f"data.{key}=True mirrors {dataset}'s images out of their "
                                 f"class (digits): set it False")
        if int(batch_size) < 1 or int(batch_size) % int(grad_accum_steps):
            raise ValueError(f"data.batch_size={batch_size} must be a positive multiple of "
                             f"grad_accum_steps={grad_accum_steps}")
        if not 0 <= int(crop_padding) < int(image_size):
            raise ValueError(f"data.crop_padding={crop_padding} must be in [0, "
                             f"model.image_size={image_size})")
        self.dataset, self.seed, self.spec = dataset, int(seed), spec
        self.batch_size, self.grad_accum_steps = int(batch_size), int(grad_accum_steps)
        self.rows_per_batch = self.batch_size // self.grad_accum_steps
        self.eval_rows_per_batch = int(eval_batch_size or self.rows_per_batch)
        self.crop_padding, self.random_flip = int(crop_padding), bool(random_flip)
        self.validation_split, self.test_split = "validation", "test"
        self.builder = open_builder(dataset, data_dir, manual_dir)
        features = self.builder.info.features
        self.class_names = tuple(features["label"].names)
        self.image_shape = (int(image_size), int(image_size), int(num_channels))
        stored = tuple(features["image"].shape)  # (None, None, 3) for imagenet2012
        if stored[2] != self.image_shape[2] or (spec.in_memory and stored != self.image_shape):
            raise ValueError(f"{dataset} images are {stored}, but the model takes "
                             f"{self.image_shape}: set model.image_size and num_channels to "
                             f"match")
        self._splits = self._open_splits()
        self.mean, self.std = self._statistics(dataset)
        self.batches_per_epoch = len(self._splits["train"]) // self.batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(f"{dataset} has {len(self._splits['train'])} training images, "
                             f"fewer than data.batch_size={self.batch_size}")
        log.info("%s: %s images (train, validation, test), %d batches of %d an epoch", dataset,
                 ", ".join(str(len(s)) for s in self._splits.values()), self.batches_per_epoch,
                 self.batch_size)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def split_size(self, split: str) -> int:
        return len(self._split(split))

    def _split(self, split: str) -> _Images:
        if split not in self._splits:
            raise ValueError(f"split={split!r} is not one of {', '.join(self._splits)}")
        return self._splits[split]

    def _open_splits(self) -> dict[str, _Images]:
        """{"train", "validation", "test"}: a TFDS split and the record indices it keeps."""
        from transformer.data.offline import fashion_mnist

        size = self.image_shape[0]
        names = ("train", "validation" if self.spec.has_validation else None,
                 self.spec.test_split)
        sources = {name: self.builder.as_data_source(split=name) for name in names if name}
        arrays = {name: _decode_all(self.builder, name) if self.spec.in_memory else None
                  for name in sources}

        def whole(name):
            return _Images(sources[name], np.arange(len(sources[name])), size, arrays[name])

        if self.spec.has_validation:
            return {"train": whole("train"), "validation": whole("validation"),
                    "test": whole(self.spec.test_split)}
        if self.spec.in_memory:
            held = np.array([fashion_mnist.hash_unit(image) < fashion_mnist.VALIDATION_FRACTION
                             for image in arrays["train"][0]], bool)
        else:
            held = np.array([_unit(str(i).encode()) < IMAGENET_VALIDATION_FRACTION
                             for i in range(len(sources["train"]))], bool)
        carved = {name: _Images(sources["train"], np.flatnonzero(mask), size, arrays["train"])
                  for name, mask in (("train", ~held), ("validation", held))}
        return carved | {"test": whole(self.spec.test_split)}

    def _statistics(self, dataset: str) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and standard deviation of the training pixels, in [0, 1] units."""
        if not self.spec.in_memory:
            return np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)
        pixels = self._split("train").all_images().reshape(-1, self.image_shape[-1]) / 255.0
        return pixels.mean(0).astype(np.float32), pixels.std(0).astype(np.float32)

    def normalise(self, images: np.ndarray) -> np.ndarray:
        """uint8 [..., C] -> float32, per-channel (x / 255 - mean) / std."""
        return ((images.astype(np.float32) / 255.0 - self.mean) / self.std).astype(np.float32)

    def fingerprint(self) -> str:
        sizes = " ".join(f"{name}={len(split)}" for name, split in self._splits.items())
        return (f"{self.builder.info.full_name} {sizes} image={self.image_shape} "
                f"mean={np.round(self.mean, 4).tolist()} std={np.round(self.std, 4).tolist()} "
                f"crop_padding={self.crop_padding} random_flip={self.random_flip}")

    def vocabulary_fingerprint(self) -> str:
        return "classes: " + ", ".join(self.class_names)

    def preprocessing(self) -> dict:
        """What `transformer.classify` needs to prepare an image as training did, recorded in
        config.json (provenance "images"): class names, per-channel mean and std."""
        return {"class_names": list(self.class_names), "mean": self.mean.tolist(),
                "std": self.std.tolist()}

    # ----------------------------------------------------------------- batches

    def batch_positions(self, index: int) -> np.ndarray:
        """Positions in the training split of global batch `index`'s images, [batch_size]."""
        count = len(self._split("train"))
        return batching.epoch_positions(index, count, self.batch_size, self.seed)

    def train_batch(self, index: int, rows: tuple[int, int]) -> dict[str, np.ndarray]:
        """Rows [start, stop) of each microbatch of global batch `index`:
        {"image": [A, stop-start, S, S, C], "label": [A, stop-start]}."""
        positions = self.batch_positions(index)
        rng = np.random.default_rng([self.seed, _AUGMENT, index])
        offsets = rng.integers(0, 2 * self.crop_padding + 1, size=(self.batch_size, 2))
        flips = (rng.random(self.batch_size) < 0.5) & self.random_flip
        wanted = np.concatenate([a * self.rows_per_batch + np.arange(*rows)
                                 for a in range(self.grad_accum_steps)])
        images, labels = self._split("train").get(positions[wanted])
        images = self.normalise(augment(images, offsets[wanted], flips[wanted],
                                        self.crop_padding))
        shape = (self.grad_accum_steps, rows[1] - rows[0])
        return {"image": images.reshape(shape + self.image_shape),
                "label": labels.astype(np.int32).reshape(shape)}

    def eval_batches(self, split: str, rows: tuple[int, int]):
        """The split once, in order, no augmentation: [1, stop-start, ...] batches of
        `eval_rows_per_batch` global rows. Rows past the end are zero images with label -1."""
        images = self._split(split)
        for first in range(0, len(images), self.eval_rows_per_batch):
            start, stop = (min(first + r, len(images)) for r in rows)
            pixels, labels = images.get(np.arange(start, stop))
            padding = rows[1] - rows[0] - (stop - start)
            pixels = np.pad(self.normalise(pixels), ((0, padding), (0, 0), (0, 0), (0, 0)))
            labels = np.pad(labels.astype(np.int32), (0, padding), constant_values=-1)
            yield {"image": pixels[None], "label": labels[None]}


def from_config(cfg) -> ImageSource:
    """`ImageSource` from the config's `data` and `model` keys (configs/vit_fashion_mnist.py).
    One line when they disagree."""
    data = cfg.data
    model = cfg.model
    if model.architecture != "vision":
        raise ValueError(f"data.dataset={data.dataset!r} is images: it trains "
                         f"model.architecture='vision', not {model.architecture!r}")
    source = ImageSource(
        data.dataset, image_size=int(model.image_size), num_channels=int(model.num_channels),
        batch_size=int(data.batch_size), grad_accum_steps=int(cfg.grad_accum_steps),
        eval_batch_size=data.get("eval_batch_size"),
        crop_padding=int(data.get("crop_padding") or 0),
        random_flip=bool(data.get("random_flip")),
        test_time_flip=bool(data.get("test_time_flip")), seed=int(cfg.seed),
        data_dir=data.get("data_dir"), manual_dir=data.get("manual_dir"))
    if source.num_classes != int(model.num_classes):
        raise ValueError(f"model.num_classes={model.num_classes} but {data.dataset} has "
                         f"{source.num_classes} classes")
    return source
