"""The offline text-classification task: LibreOffice help paragraphs labelled by the module
whose help they belong to, in English and in German.

The help tree of the `offline_de_en` packages (`offline_corpus`) keeps each module's pages under
`text/<module>/`: Writer (`swriter`), Calc, Impress, Draw, Base (`sdatabase`), Math, Chart and
Basic (`sbasic`); `text/shared/` belongs to none and is left out. A paragraph of at least
`MIN_WORDS` English words becomes two examples, the English text and its German translation
(paired by paragraph id), both with the module's label. An English paragraph found under two
modules is ambiguous and dropped. Repeats within a module are kept once. Splits follow a stable
hash of the normalised English text (`corpus.hash_unit`), so no paragraph is in two
splits and a paragraph and its translation are always in the same one. Pure Python: the TFDS
builder over this is `transformer.data.offline.help_topics`.
"""

from __future__ import annotations

from transformer.data.offline import corpus

MODULES = {"swriter": "Writer", "scalc": "Calc", "simpress": "Impress", "sdraw": "Draw",
           "sdatabase": "Base", "smath": "Math", "schart": "Chart", "sbasic": "Basic"}
LABELS = tuple(MODULES.values())
MIN_WORDS = 4
TEST_FRACTION = 0.1
VALIDATION_FRACTION = 0.1


def labelled_pairs(root: str) -> list[tuple[str, str, int]]:
    """(en, de, label index) for the help paragraphs under an unpacked root, in a stable order."""
    found: dict[str, list[tuple[str, str, int]]] = {}
    for label, module in enumerate(MODULES):
        for _, pairs in corpus.help_page_pairs(root, f"text/{module}"):
            for en, de in pairs:
                if len(en.split()) >= MIN_WORDS and en != de:
                    found.setdefault(corpus.normalise(en), []).append((en, de, label))
    kept = []
    for examples in found.values():
        if len({label for _, _, label in examples}) == 1:
            kept.append(examples[0])
    return kept


def split_examples(pairs) -> dict[str, list[dict]]:
    """{"train", "validation", "test"}: examples {"text", "label", "language"}, both languages
    of a pair in the split its English text hashes to."""
    splits = {"train": [], "validation": [], "test": []}
    for en, de, label in pairs:
        u = corpus.hash_unit(en)
        split = ("test" if u < TEST_FRACTION else
                 "validation" if u < TEST_FRACTION + VALIDATION_FRACTION else "train")
        splits[split] += [{"text": en, "label": label, "language": "en"},
                          {"text": de, "label": label, "language": "de"}]
    return splits
