"""The real `wmt14_translate/de-en` builder on tiny raw archives in the official layout (a
manual_dir with the official file names; their checksums are skipped, as they are fakes), read
with `download=False`, the one-time TFRecord -> array_record conversion, and the Source on it."""

import io
import tarfile

import pytest
import tensorflow_datasets as tfds

from transformer.data import datasets, translation  # noqa: E402

EN = ["The house is small.", "I like green tea.", "Where is the station?", "We are reading.",
      "Open the file.", "Close the window.", "The dog sleeps.", "It is raining today."]
DE = ["Das Haus ist klein.", "Ich mag grünen Tee.", "Wo ist der Bahnhof?", "Wir lesen.",
      "Öffne die Datei.", "Schließe das Fenster.", "Der Hund schläft.", "Es regnet heute."]


def _tgz(path, files: dict[str, str]):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _sgm(lines, lang, kind):
    segs = "\n".join(f'<seg id="{i + 1}">{line}</seg>' for i, line in enumerate(lines))
    return (f'<{kind}set setid="newstest2014" srclang="de" trglang="en">\n'
            f'<doc sysid="ref" docid="d1" genre="news" origlang="{lang}">\n<p>\n{segs}\n</p>\n'
            f'</doc>\n</{kind}set>\n')


def _raw_wmt14(manual):
    manual.mkdir()
    lines = lambda xs: "\n".join(xs) + "\n"  # noqa: E731
    _tgz(manual / "training-parallel-europarl-v7.tgz", {
        "training/europarl-v7.de-en.de": lines(DE[:3]),
        "training/europarl-v7.de-en.en": lines(EN[:3])})
    _tgz(manual / "training-parallel-commoncrawl.tgz", {
        "commoncrawl.de-en.de": lines(DE[3:5]), "commoncrawl.de-en.en": lines(EN[3:5])})
    _tgz(manual / "training-parallel-nc-v9.tgz", {
        "training/news-commentary-v9.de-en.de": lines(DE[5:]),
        "training/news-commentary-v9.de-en.en": lines(EN[5:])})
    _tgz(manual / "dev.tgz", {
        "dev/newstest2013.de": lines(DE[:2]), "dev/newstest2013.en": lines(EN[:2]),
        "dev/newstest2014-deen-src.de.sgm": _sgm(DE[2:5], "de", "src"),
        "dev/newstest2014-deen-ref.en.sgm": _sgm(EN[2:5], "de", "ref")})


@pytest.fixture
def skip_checksums(monkeypatch):
    """The archives are fakes: record their checksums instead of validating them."""
    from tensorflow_datasets.core.download import download_manager

    monkeypatch.setattr(download_manager.DownloadManager, "_register_or_validate_checksums",
                        lambda self, url, url_info, path: None)


def test_wmt14_builder_on_local_files(tmp_path, skip_checksums):
    manual = tmp_path / "manual"
    _raw_wmt14(manual)
    builder = datasets.prepare_dataset("wmt14_translate/de-en", data_dir=str(tmp_path / "a"),
                                          manual_dir=str(manual))
    sizes = {name: info.num_examples for name, info in builder.info.splits.items()}
    assert sizes == {"train": 8, "validation": 2, "test": 3}
    assert builder.info.supervised_keys == ("de", "en")  # TFDS's direction; the paper's is en->de
    test = tfds.data_source("wmt14_translate/de-en", split="test", data_dir=str(tmp_path / "a"),
                            download=False)
    assert {(test[i]["en"].decode(), test[i]["de"].decode()) for i in range(3)} == set(
        zip(EN[2:5], DE[2:5], strict=True))

    # A dataset prepared elsewhere in TFRecord: converted to array_record once, then read.
    tfrecord = tfds.builder("wmt14_translate/de-en", data_dir=str(tmp_path / "b"))
    tfrecord.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=str(manual)))
    assert tfrecord.info.file_format.value == "tfrecord"
    source = translation.TranslationSource(
        "wmt14_translate/de-en", source_lang="en", target_lang="de", vocab_size=120,
        max_length=16, batch_size=4, tokens_per_batch=40, data_dir=str(tmp_path / "b"))
    seen = [i for b in range(source.plans.batches_in_epoch(0))
            for i in source.batch_examples(b)[0].tolist()]
    assert sorted(seen) == list(range(8))
    batch = source.train_batch(0, (0, 4))
    assert batch["inputs"].shape == (1, 4, 16)
    row = batch["inputs"][0, 0]
    first = source.tokenizer.decode(row[batch["inputs_segmentation"][0, 0] == 1])
    assert first in EN  # English is the source side
    assert sum(len(list(source.eval_batches(split, (0, 4)))) for split in ("validation",
                                                                             "test")) == 2
