"""TFDS access for the sources: preparing a dataset in `array_record` format (random access),
converting one prepared in TFRecord once, reading text pairs by index, and a split's documents
by id (`TfdsDocuments`).

`prepare_dataset` never downloads WMT (statmt.org is slow and often unreachable): without a
prepared dataset or the raw archives in `data.manual_dir` it stops with one line naming the
files. `offline_de_en` builds itself from Debian packages (`offline/de_en.py`).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import os
import sys

import numpy as np

log = logging.getLogger("transformer")
CHUNK = 8192  # records per read when scanning a split


class DataUnavailable(ValueError):
    """The dataset is not prepared and cannot be prepared here. The message says what to do
    (a ValueError, so train.py prints it as one line)."""


# --------------------------------------------------------------------------- TFDS


def tensorflow():
    """TensorFlow, kept off the GPUs (the input pipeline never needs an accelerator). Imported
    only where it works: preparing a dataset, converting TFRecord, decoding images. Reading a
    prepared array_record split needs TFDS alone, and a process then saves TensorFlow's import
    (4-5 CPU s)."""
    import tensorflow as tf

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # already initialised
        pass
    return tf


def _tfds():
    import tensorflow_datasets as tfds

    if "tensorflow" in sys.modules:  # imported by someone else: off the GPUs all the same
        tensorflow()
    if not sys.stderr.isatty():  # bars in a terminal; none in a log file or a pipe
        tfds.disable_progress_bar()
    return tfds


@contextlib.contextmanager
def tfds_quietly():
    """TFDS's own chatter off the screen while it finds or prepares a dataset (our lines say
    what happens): its warnings about half-built folders and its banner on stdout. Its errors
    stay."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        absl_logger.setLevel(level)


def _wmt_manual_files(builder) -> list[str]:
    """The raw archive names a WMT builder wants (from its sub-dataset URLs)."""
    from tensorflow_datasets.translate import wmt

    source, _ = builder.builder_config.language_pair
    names = []
    for subset in sorted({s for ss in builder.subsets.values() for s in ss}):
        for url in wmt.DATASET_MAP[subset].get_url(source):
            name = url.rsplit("/", 1)[-1]
            if name not in names:
                names.append(name)
    return names


def prepare_dataset(name: str, data_dir: str | None = None, manual_dir: str | None = None):
    """The TFDS builder of `name`, prepared in array_record format (see the module docstring).
    Never downloads WMT: without a prepared dataset or the raw files it raises
    `DataUnavailable` with one line naming what to provide."""
    tfds = _tfds()
    if name.split("/")[0] == "offline_de_en":
        from transformer.data.offline import de_en  # noqa: F401  (registers the builder)
    try:
        with tfds_quietly():
            builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # unknown name or config
        # TFDS's own builders only: the community index is fetched from GCS (5 s, or a
        # network timeout offline) for a hint
        known = tfds.list_builders(with_community_datasets=False) + ["offline_de_en"]
        close = difflib.get_close_matches(name.split("/")[0], known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        if "/" in name:  # `c4/en` is TFDS's; `mydata/train` may be meant as a path
            hint += (f" (as a path: nothing exists at {os.path.abspath(name)!r}; check it, or "
                     f"write <format>:<glob>)")
        raise DataUnavailable(f"data.dataset={name!r}: {str(e).splitlines()[0]}{hint}") from None
    with tfds_quietly():
        prepared = builder.is_prepared()
    if prepared:
        return _ensure_array_record(builder)
    kwargs = {}
    tensorflow()  # preparing reads and writes through TensorFlow
    from tensorflow_datasets.translate import wmt

    if isinstance(builder, wmt.WmtTranslate):  # wmt14_translate, wmt_t2t_translate, ...
        wanted = _wmt_manual_files(builder)
        missing = [f for f in wanted if not manual_dir or not os.path.exists(
            os.path.join(manual_dir, f))]
        if missing:
            raise DataUnavailable(
                f"{name} is not prepared in {builder.data_dir}: put {', '.join(missing)} in "
                f"a directory and pass --config.data.manual_dir=<it>, or copy a prepared "
                f"dataset into --config.data.data_dir (docs/data.md)")
        kwargs["download_config"] = tfds.download.DownloadConfig(manual_dir=manual_dir)
    elif manual_dir:
        kwargs["download_config"] = tfds.download.DownloadConfig(manual_dir=manual_dir)
    log.info("preparing %s in %s (array_record)", name, builder.data_dir)
    with tfds_quietly():
        builder.download_and_prepare(file_format="array_record", **kwargs)
        return tfds.builder(name, data_dir=data_dir)


def _ensure_array_record(builder):
    """Converts a dataset prepared in TFRecord to array_record once, in place (the same shards,
    record for record, and `array_record` added to dataset_info.json's alternative formats)."""
    from tensorflow_datasets.core import dataset_info, file_adapters

    info = builder.info
    proto = dataset_info.read_proto_from_builder_dir(builder.data_dir)
    if "array_record" not in {proto.file_format, *proto.alternative_file_formats}:
        log.info("converting %s to array_record once (random access)", builder.data_dir)
        tensorflow()  # TFRecord is read through TensorFlow
        reader = file_adapters.ADAPTER_FOR_FORMAT[info.file_format]
        writer = file_adapters.ADAPTER_FOR_FORMAT[file_adapters.FileFormat.ARRAY_RECORD]
        suffix = f".{info.file_format.value}-"
        try:
            for split in info.splits.values():
                for path in map(os.fspath, split.filepaths):
                    target = path.replace(suffix, ".array_record-")
                    tmp = f"{target}.incomplete{os.getpid()}"
                    records = ((i, r.numpy()) for i, r in enumerate(reader.make_tf_data(path)))
                    writer.write_examples(tmp, records)
                    os.replace(tmp, target)
            proto.alternative_file_formats.append("array_record")
            dataset_info.write_dataset_info_proto(proto, dataset_info_dir=builder.data_dir)
        except OSError as e:
            raise DataUnavailable(
                f"{builder.data_dir} is in {info.file_format.value} format and could not be "
                f"converted to array_record in place ({e}); copy it somewhere writable and set "
                f"--config.data.data_dir") from None
    if "array_record" not in {f.value for f in info.available_file_formats()}:
        info.add_alternative_file_format("array_record")  # TFDS reads it back only read-only
    return builder


def _text(record, lang: str) -> str:
    """One language's text from a record (a dict of numpy values or bytes; a tf.train.Example
    too)."""
    if hasattr(record, "features"):
        value = record.features.feature[lang].bytes_list.value[0]
    else:
        value = record[lang]
        if isinstance(value, np.ndarray):
            value = value.item()
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def open_split(builder, split: str):
    """A split's records by index, as dicts of numpy values: TFDS parses them without
    TensorFlow (23 us a record against 10 us as tf.train.Example, measured on one core; a
    process then saves TensorFlow's 4-5 CPU s import)."""
    return builder.as_data_source(split=split)


def read_pairs(source, indices, source_lang: str, target_lang: str):
    """[(source text, target text)] of `indices` of a data source, read in chunks."""
    pairs = []
    indices = [int(i) for i in indices]
    get_many = getattr(source, "__getitems__", None)
    for i in range(0, len(indices), CHUNK):
        chunk = indices[i:i + CHUNK]
        records = get_many(chunk) if get_many else [source[j] for j in chunk]
        pairs.extend((_text(r, source_lang), _text(r, target_lang)) for r in records)
    return pairs


def text_features(builder) -> list[str]:
    """The text features of a TFDS dataset to model: a translation dataset's languages
    (`offline_de_en`: de, en), else its feature `text` (`lm1b`, `c4`; c4's url and timestamp
    are text too), else all its `Text` features."""
    import tensorflow_datasets as tfds

    features = builder.info.features
    if hasattr(features, "languages"):
        return sorted(features.languages)
    if "text" in features:
        return ["text"]
    return sorted(k for k, f in features.items() if isinstance(f, tfds.features.Text))


def read_documents(source, indices, keys: list[str]) -> list[str]:
    """The texts of documents `indices` of a data source, where document d is text feature
    keys[d % len(keys)] of record d // len(keys)."""
    indices = [int(i) for i in indices]
    fetched = {r: source[r] for r in sorted({i // len(keys) for i in indices})}
    return [_text(fetched[d // len(keys)], keys[d % len(keys)]) for d in indices]


def text_splits(dataset: str, splits: dict[str, str], seed: int, data_dir: str | None = None,
                manual_dir: str | None = None) -> tuple[dict, list[str], str]:
    """The documents of a TFDS text dataset's `splits` ({setting: split}, the setting naming
    the split in errors) as {split: `TfdsDocuments`}, its text features and its full name. A
    split that is missing or empty is one line."""
    builder = prepare_dataset(dataset, data_dir, manual_dir)
    keys = text_features(builder)
    if not keys:
        raise ValueError(f"data.dataset={dataset!r} has no text feature to model")
    known = sorted(builder.info.splits)  # empty under tfds.testing.mock_data
    documents = {}
    for setting, split in splits.items():
        if known and split not in known:
            raise ValueError(f"{setting}={split!r} is not a split of {dataset} "
                             f"({', '.join(known)})")
        documents[split] = TfdsDocuments(builder, split, keys, seed)
        if not len(documents[split]):
            fix = "prepare the dataset again" + (
                "" if split == "train" else f" or choose another {setting}")
            raise DataUnavailable(f"{dataset}: the {split!r} split is empty; {fix}")
    return documents, keys, builder.info.full_name


class TfdsDocuments:
    """The documents of one split of a TFDS text dataset, by id: document d is text feature
    keys[d % F] of record d // F, with F the number of `keys`. The split is opened when first
    read."""

    def __init__(self, builder, split: str, keys: list[str], seed: int = 0):
        self.builder, self.split, self.keys = builder, split, keys
        self.seed = int(seed)
        self._source = None
        self._order: tuple[int | None, np.ndarray | None] = (None, None)

    @property
    def source(self):
        if self._source is None:
            self._source = open_split(self.builder, self.split)
        return self._source

    def __len__(self) -> int:
        return len(self.source) * len(self.keys)

    def texts(self, ids) -> list[str]:
        return read_documents(self.source, ids, self.keys)

    def sample(self, count: int, key: tuple[int, ...]) -> np.ndarray:
        """At most `count` distinct document ids, sorted, drawn with seed (seed, *key)."""
        rng = np.random.default_rng([self.seed, *key])
        return np.sort(rng.permutation(len(self))[:count])

    def order(self, epoch: int, positions) -> np.ndarray:
        """The ids at `positions` of epoch `epoch`'s seeded permutation of the documents. The
        latest epoch's permutation is kept: each batch of the epoch cuts its run from it."""
        kept_epoch, permutation = self._order
        if kept_epoch != epoch:
            permutation = np.random.default_rng([self.seed, epoch]).permutation(len(self))
            self._order = (epoch, permutation)
        return permutation[np.asarray(positions, np.int64)]
