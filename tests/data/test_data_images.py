"""Images: the `offline_fashion_mnist` builder on the committed fixture (360 training and 120
test images of Debian's dataset-fashion-mnist, in its own idx format, with its copyright file:
tests/data/offline_fashion_mnist/NOTICE), and the image pipeline (`transformer/data/images.py`):
normalisation, augmentation, batches as a pure function of (seed, index) and of the row range."""

import pathlib

import numpy as np
import pytest

from transformer.data.images import DataUnavailable, ImageSource, augment, resize_and_crop
from transformer.data.offline import fashion_mnist

FIXTURE = pathlib.Path(__file__).parent / "offline_fashion_mnist"


@pytest.fixture(scope="module")
def data_dir(offline_data_dir):
    return offline_data_dir("offline_fashion_mnist")


def source(data_dir, **kwargs):
    values = dict(image_size=28, num_channels=1, batch_size=8, crop_padding=2,
                  random_flip=True, seed=3, data_dir=str(data_dir))
    return ImageSource("offline_fashion_mnist", **(values | kwargs))


def test_idx_files_round_trip(tmp_path):
    images, labels = fashion_mnist.read_split(str(FIXTURE), "train")
    assert images.shape == (360, 28, 28, 1) and images.dtype == np.uint8
    assert labels.shape == (360,) and set(labels.tolist()) == set(range(10))
    path = tmp_path / "x.gz"
    fashion_mnist.write_idx(str(path), images[:5, ..., 0])
    np.testing.assert_array_equal(fashion_mnist.read_idx(str(path)), images[:5, ..., 0])
    fixture = FIXTURE / fashion_mnist.DATA_DIR / fashion_mnist.FILES["train"][0]
    assert path.read_bytes()[:10] == fixture.read_bytes()[:10]  # gzip header, mtime 0, as written


def test_builder_on_the_fixture(data_dir):
    import tensorflow_datasets as tfds

    builder = tfds.builder("offline_fashion_mnist", data_dir=str(data_dir))
    sizes = {name: split.num_examples for name, split in builder.info.splits.items()}
    expected, dropped = fashion_mnist.split_examples(str(FIXTURE))
    assert sizes == {name: len(labels) for name, (_, labels) in expected.items()}
    assert sizes == {"train": 326, "validation": 34, "test": 120} and dropped == 0
    assert builder.info.metadata["examples"] == sizes
    assert builder.info.features["label"].names == list(fashion_mnist.CLASS_NAMES)
    licence = pathlib.Path(builder.data_dir) / "licenses" / "dataset-fashion-mnist.copyright"
    assert "License: Expat" in licence.read_text()
    seen = {}
    for split in sizes:
        data = tfds.data_source("offline_fashion_mnist", split=split, data_dir=str(data_dir),
                                download=False)
        for i in range(len(data)):
            record = data[i]
            assert record["image"].shape == (28, 28, 1) and 0 <= record["label"] < 10
            key = record["image"].tobytes()
            assert seen.setdefault(key, split) == split, "an image in two splits"
            if split != "test":
                held = fashion_mnist.hash_unit(record["image"]) < fashion_mnist.VALIDATION_FRACTION
                assert held == (split == "validation")
    assert len(seen) == 480


def test_training_copies_of_test_images_are_dropped(tmp_path):
    root = tmp_path / "root"
    (root / fashion_mnist.DATA_DIR).mkdir(parents=True)
    train, train_labels = fashion_mnist.read_split(str(FIXTURE), "train")
    test, test_labels = fashion_mnist.read_split(str(FIXTURE), "test")
    train = np.concatenate([train[:20], test[:3]])
    train_labels = np.concatenate([train_labels[:20], test_labels[:3]])
    files = fashion_mnist.FILES.values()
    for (images_file, labels_file), (x, y) in zip(
            files, [(train, train_labels), (test, test_labels)], strict=True):
        fashion_mnist.write_idx(str(root / fashion_mnist.DATA_DIR / images_file), x[..., 0])
        fashion_mnist.write_idx(str(root / fashion_mnist.DATA_DIR / labels_file), y)
    splits, dropped = fashion_mnist.split_examples(str(root))
    assert dropped == 3 and len(splits["train"][0]) + len(splits["validation"][0]) == 20


def test_statistics_and_normalisation(data_dir):
    src = source(data_dir)
    train, _ = fashion_mnist.read_split(str(FIXTURE), "train")
    kept = np.array([fashion_mnist.hash_unit(x) >= fashion_mnist.VALIDATION_FRACTION
                     for x in train])
    pixels = train[kept] / 255.0
    np.testing.assert_allclose(src.mean, [pixels.mean()], rtol=1e-5)
    np.testing.assert_allclose(src.std, [pixels.std()], rtol=1e-5)
    batch = next(src.eval_batches("validation", (0, 8)))
    raw, _ = src._split("validation").get(np.arange(8))
    np.testing.assert_allclose(batch["image"][0], (raw / 255.0 - src.mean) / src.std, atol=1e-5)


def test_augment_against_hand_crops_and_flips():
    images = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3, 1) + 1
    out = augment(images, np.array([[0, 0], [2, 1]]), np.array([False, True]), 1)
    padded = np.pad(images[..., 0], ((0, 0), (1, 1), (1, 1)))
    np.testing.assert_array_equal(out[0, ..., 0], padded[0, 0:3, 0:3])
    np.testing.assert_array_equal(out[1, ..., 0], padded[1, 2:5, 1:4][:, ::-1])
    same = augment(images, np.zeros((2, 2), int), np.zeros(2, bool), 0)
    np.testing.assert_array_equal(same, images)


def test_batches_are_a_pure_function_of_seed_index_and_rows(data_dir):
    src = source(data_dir, batch_size=8, grad_accum_steps=2)
    first = src.train_batch(5, (0, 4))
    assert first["image"].shape == (2, 4, 28, 28, 1) and first["image"].dtype == np.float32
    assert first["label"].shape == (2, 4) and first["label"].dtype == np.int32
    again = source(data_dir, batch_size=8, grad_accum_steps=2).train_batch(5, (0, 4))
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    halves = [src.train_batch(5, rows) for rows in ((0, 1), (1, 4))]  # two processes' rows
    for key in first:
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves], axis=1),
                                      first[key])
    assert not np.array_equal(src.train_batch(6, (0, 4))["image"], first["image"])
    other_seed = source(data_dir, batch_size=8, grad_accum_steps=2, seed=4).train_batch(5, (0, 4))
    assert not np.array_equal(other_seed["image"], first["image"])
    # an epoch is a permutation of the training split; the next epoch another one
    epoch = np.concatenate([src.batch_positions(i) for i in range(src.batches_per_epoch)])
    assert src.batches_per_epoch == 326 // 8 and len(set(epoch.tolist())) == len(epoch)
    assert not np.array_equal(src.batch_positions(src.batches_per_epoch), src.batch_positions(0))


def test_eval_batches_cover_the_split_once_with_padding_rows(data_dir):
    src = source(data_dir, eval_batch_size=16)
    halves = [list(src.eval_batches("test", rows)) for rows in ((0, 10), (10, 16))]
    labels = np.concatenate([np.concatenate([a["label"], b["label"]], axis=1)[0]
                             for a, b in zip(*halves, strict=True)])
    assert len(labels) == 128 and (labels[120:] == -1).all()
    # every test image once (TFDS stores a split in its own shuffled order)
    np.testing.assert_array_equal(np.sort(labels[:120]),
                                  np.sort(fashion_mnist.read_split(str(FIXTURE), "test")[1]))
    last = halves[1][-1]["image"][0]
    assert not last[2:].any()  # padding rows are zeros
    again = [b["image"] for b in src.eval_batches("test", (0, 10))]
    np.testing.assert_array_equal(again[0], halves[0][0]["image"])  # no augmentation


def test_bad_settings_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="data.random_flip=True mirrors mnist's images"):
        ImageSource("mnist", image_size=28, num_channels=1, batch_size=8, random_flip=True)
    with pytest.raises(ValueError, match="data.test_time_flip=True mirrors mnist's images"):
        ImageSource("mnist", image_size=28, num_channels=1, batch_size=8, test_time_flip=True)
    with pytest.raises(ValueError, match="'svhn' is not an image dataset"):
        ImageSource("svhn", image_size=32, num_channels=3, batch_size=8)
    with pytest.raises(DataUnavailable, match="fashion_mnist is not prepared in .* "
                       "never downloaded here") as error:
        ImageSource("fashion_mnist", image_size=28, num_channels=1, batch_size=8,
                    data_dir=str(tmp_path))
    assert "\n" not in str(error.value)


def test_model_and_data_disagree_is_one_line(data_dir):
    with pytest.raises(ValueError, match=r"images are \(28, 28, 1\), but the model takes "
                                         r"\(32, 32, 1\)"):
        source(data_dir, image_size=32)


def test_resize_and_crop_keeps_the_centre():
    image = np.zeros((40, 60, 3), np.uint8)
    image[:, 20:40] = 255  # the centre third of the columns
    out = resize_and_crop(image, 20)
    assert out.shape == (20, 20, 3)
    # 40x60 -> 20x30, white columns 10..19; the crop keeps columns 5..24: white at 5..14
    assert (out[:, 6:14] == 255).all() and not out[:, :4].any() and not out[:, 16:].any()


def test_a_small_png_split_is_decoded_without_tensorflow_to_the_same_pixels(data_dir,
                                                                           monkeypatch):
    """A split of at most PILLOW_MAX_RECORDS lossless images is decoded by Pillow (no
    TensorFlow import, 4-5 CPU s a process): the arrays TensorFlow's decoding gives."""
    import tensorflow_datasets as tfds

    from transformer.data import images

    builder = tfds.builder("offline_fashion_mnist", data_dir=str(data_dir))

    def refused():
        raise AssertionError("TensorFlow was asked for")

    with monkeypatch.context() as patched:
        patched.setattr(images, "tensorflow", refused)
        pillow = images._decode_all(builder, "test")
    monkeypatch.setattr(images, "PILLOW_MAX_RECORDS", 0)
    tensorflow = images._decode_all(builder, "test")
    assert pillow[0].shape == (120, 28, 28, 1)
    for got, want in zip(pillow, tensorflow, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
