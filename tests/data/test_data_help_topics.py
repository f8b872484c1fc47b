"""The offline text-classification dataset `offline_help_topics` on the committed help pages."""

import pathlib

from transformer.data.offline import corpus, help_paragraphs

FIXTURE = pathlib.Path(__file__).parent / "offline_help_topics"


def _page(title: str, paragraphs: dict[str, str]) -> str:
    body = "".join(f'<p id="{key}">{text}</p>' for key, text in paragraphs.items())
    return f"<html><head><title>{title}</title></head><body>{body}</body></html>"


def test_labels_come_from_the_module_folder_and_ambiguous_paragraphs_drop(tmp_path):
    pages = {  # (module, page): {paragraph id: (en, de)}
        ("swriter", "a.html"): {"par_id1": ("Inserts a table into the text.",
                                            "Fügt eine Tabelle in den Text ein."),
                                "par_id2": ("Click OK to close it now.",
                                            "Klicken Sie auf OK, um es zu schließen."),
                                "par_id3": ("Too short.", "Zu kurz.")},
        ("scalc", "b.html"): {"par_id4": ("Sums the cells of a range.",
                                          "Summiert die Zellen eines Bereichs."),
                              "par_id5": ("Click OK to close it now.",
                                          "Klicken Sie auf OK, um es zu schließen.")},
        ("shared", "c.html"): {"par_id6": ("Shared by every module here.",
                                           "Von jedem Modul geteilt.")},
    }
    for (module, page), paragraphs in pages.items():
        for lang, side in (("en-US", 0), ("de", 1)):
            path = tmp_path / corpus.HELP_DIR / lang / "text" / module / page
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_page(page, {k: v[side] for k, v in paragraphs.items()}))
    pairs = help_paragraphs.labelled_pairs(str(tmp_path))
    writer = help_paragraphs.LABELS.index("Writer")
    calc = help_paragraphs.LABELS.index("Calc")
    assert pairs == [("Inserts a table into the text.", "Fügt eine Tabelle in den Text ein.",
                      writer),
                     ("Sums the cells of a range.", "Summiert die Zellen eines Bereichs.", calc)]


def test_splits_keep_a_paragraph_and_its_translation_together():
    pairs = help_paragraphs.labelled_pairs(str(FIXTURE))
    assert {label for _, _, label in pairs} == set(range(len(help_paragraphs.LABELS)))
    splits = help_paragraphs.split_examples(pairs)
    assert sum(map(len, splits.values())) == 2 * len(pairs)
    where = {}
    for split, examples in splits.items():
        for en_example, de_example in zip(examples[::2], examples[1::2], strict=True):
            assert (en_example["language"], de_example["language"]) == ("en", "de")
            assert en_example["label"] == de_example["label"]
            assert corpus.normalise(en_example["text"]) not in where
            where[corpus.normalise(en_example["text"])] = split
    for en, _, _ in pairs:
        u = corpus.hash_unit(en)
        assert where[corpus.normalise(en)] == (
            "test" if u < 0.1 else "validation" if u < 0.2 else "train")


def test_the_tfds_builder_on_the_fixture(offline_data_dir):
    import tensorflow_datasets as tfds

    data_dir = offline_data_dir("offline_help_topics")
    builder = tfds.builder("offline_help_topics", data_dir=str(data_dir))
    expected = help_paragraphs.split_examples(help_paragraphs.labelled_pairs(str(FIXTURE)))
    for split, examples in expected.items():
        source = tfds.data_source("offline_help_topics", split=split, data_dir=str(data_dir),
                                  download=False)
        got = [source[i] for i in range(len(source))]
        assert sorted((g["text"].decode(), int(g["label"])) for g in got) == sorted(
            (e["text"], e["label"]) for e in examples)  # TFDS stores them shuffled
    info = builder.info
    assert info.features["label"].names == list(help_paragraphs.LABELS)
    assert info.metadata["examples"] == {k: len(v) for k, v in expected.items()}
    assert (pathlib.Path(builder.data_dir) / "licenses" /
            "libreoffice-help-en-us.copyright").exists()
