"""TFDS dataset `offline_fashion_mnist`: Fashion-MNIST (Xiao, Rasul and Vollgraf 2017; Zalando,
MIT/Expat licence) built offline from Debian's `dataset-fashion-mnist` package.

Importing this module registers the builder, so `tfds.builder("offline_fashion_mnist")`,
`tfds.load(..., download=False)` and `tfds.data_source(...)` find it. The first
`download_and_prepare` runs `apt-get download dataset-fashion-mnist` (30.9 MB; it needs Debian
package lists, i.e. `apt-get update` once, and installs nothing) into
`<data_dir>/downloads/offline_fashion_mnist/` and unpacks it there with `dpkg-deb -x`. A
`manual_dir` holding an unpacked tree (`usr/share/datasets/fashion-mnist/*.gz`) is used instead
(the tests' fixture, tests/data/offline_fashion_mnist).

The package ships the original files: 60,000 training and 10,000 test images, 28x28 grey, in
the idx format (gzip). Splits: `test` is the test file; `validation` is the training images whose
stable hash (sha256 of the pixel bytes) falls below 1/12 (about 5,000, as MNIST's classic
55,000/5,000), `train` the rest. A training image identical to a test image is dropped, so no
image is in two splits. Features match TFDS's `fashion_mnist` (`image` uint8 [28, 28, 1],
`label` of the same ten class names). The package's version and the .deb's sha256 are in
`info.metadata`. Its copyright file is copied to `<dataset dir>/licenses/`.
"""

from __future__ import annotations

import gzip
import hashlib
import os

import numpy as np
import tensorflow_datasets as tfds

from transformer.data.offline import debian

PACKAGE = "dataset-fashion-mnist"
DATA_DIR = "usr/share/datasets/fashion-mnist"
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
               "Sneaker", "Bag", "Ankle boot")
VALIDATION_FRACTION = 1 / 12
_DESCRIPTION = """Fashion-MNIST: 28x28 grey images of Zalando's articles in ten classes, from
Debian's dataset-fashion-mnist. Validation: the training images whose pixel hash falls below
1/12; training copies of test images dropped."""
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


# --------------------------------------------------------------------------- reading


def read_idx(path: str) -> np.ndarray:
    """An idx file (gzip): magic 0 0 <type> <ndim>, ndim big-endian int32 sizes, the data."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an idx file")
    ndim = raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw, ">i4", ndim, offset=4))
    return np.frombuffer(raw, _IDX_TYPES[raw[2]], offset=4 + 4 * ndim).reshape(shape)


def write_idx(path: str, array: np.ndarray) -> None:
    """`array` (uint8) as a gzip idx file, reproducibly (gzip mtime 0): the fixture's writer."""
    array = np.ascontiguousarray(array, np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">i4").tobytes()
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(header + array.tobytes())


def read_split(root: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 28, 28, 1] uint8, labels [N] int64) of the package's "train" or "test"
    files under an unpacked root."""
    images_file, labels_file = (os.path.join(root, DATA_DIR, f) for f in FILES[split])
    for path in (images_file, labels_file):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: not an unpacked {PACKAGE} tree")
    images = read_idx(images_file)
    labels = read_idx(labels_file)
    if images.ndim != 3 or labels.shape != images.shape[:1]:
        raise ValueError(f"{images_file} holds {images.shape}, {labels_file} {labels.shape}: "
                         f"not matching image and label files")
    return images[..., None], labels.astype(np.int64)


def hash_unit(image: np.ndarray) -> float:
    """A stable number in [0, 1) from an image's pixel bytes (sha256)."""
    digest = hashlib.sha256(np.ascontiguousarray(image).tobytes()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_examples(root: str) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]:
    """({"train", "validation", "test"}: (images, labels)), and how many training images were
    dropped as copies of test images (module docstring)."""
    train_images, train_labels = read_split(root, "train")
    test_images, test_labels = read_split(root, "test")
    in_test = {image.tobytes() for image in test_images}
    keep = np.array([image.tobytes() not in in_test for image in train_images], bool)
    validation = np.array([hash_unit(image) < VALIDATION_FRACTION for image in train_images])
    splits = {"train": keep & ~validation, "validation": keep & validation}
    out = {name: (train_images[mask], train_labels[mask]) for name, mask in splits.items()}
    out["test"] = (test_images, test_labels)
    return out, int((~keep).sum())


# --------------------------------------------------------------------------- the builder


class OfflineFashionMnist(tfds.core.GeneratorBasedBuilder):
    """Fashion-MNIST from Debian's dataset-fashion-mnist: train, validation, test."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Debian dataset-fashion-mnist; validation by pixel hash."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = f"""Optional. Without a manual_dir the builder runs
    `apt-get download {PACKAGE}` itself. A manual_dir may hold the package already unpacked
    with `dpkg-deb -x` ({DATA_DIR}/*.gz)."""

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=_DESCRIPTION,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(28, 28, 1)),
                "label": tfds.features.ClassLabel(names=CLASS_NAMES)}),
            supervised_keys=("image", "label"),
            homepage="https://github.com/zalandoresearch/fashion-mnist",
            metadata=tfds.core.MetadataDict(),
            license="MIT (Expat), Zalando SE 2017 (licenses/dataset-fashion-mnist.copyright)",
        )

    def _split_generators(self, dl_manager):
        root, packages = debian.unpacked_root(
            dl_manager, (PACKAGE,), cache="offline_fashion_mnist", marker=DATA_DIR,
            dataset="offline_fashion_mnist",
            alternative="or use a prepared fashion_mnist (data.dataset=fashion_mnist)")
        splits, dropped = split_examples(root)
        self.info.metadata.update({
            "packages": packages,
            "examples": {name: len(labels) for name, (_, labels) in splits.items()},
            "train_copies_of_test_dropped": dropped,
            "split_rule": "test: the t10k files; validation: training images whose sha256 of "
                          "the pixel bytes, as a fraction of 2^64, is below 1/12",
        })
        debian.copy_licences(root, (PACKAGE,), os.fspath(self.data_dir))
        return {name: self._generate_examples(*arrays) for name, arrays in splits.items()}

    def _generate_examples(self, images, labels):
        for index, (image, label) in enumerate(zip(images, labels, strict=True)):
            yield index, {"image": image, "label": int(label)}
