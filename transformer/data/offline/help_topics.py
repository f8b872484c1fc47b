"""TFDS dataset `offline_help_topics`: LibreOffice help paragraphs labelled by module
(`help_topics`), English and German, for fine-tuning text classifiers offline.

Importing this module registers the builder (`tfds.builder("offline_help_topics")`,
`tfds.data_source(...)`). Like `offline_de_en`, the first `download_and_prepare` fetches the
LibreOffice help packages with `apt-get download` and unpacks them with `dpkg-deb -x` (nothing
installed; the download is shared with `offline_de_en`), or reads an unpacked tree from
`manual_dir` (the tests' fixture). Package versions and sha256 and the examples per split and
label are in `info.metadata`. The packages' copyright files are copied to `licenses/`.
"""

from __future__ import annotations

import collections
import os

import tensorflow_datasets as tfds

from transformer.data.offline import corpus, de_en, debian, help_paragraphs

_DESCRIPTION = """Paragraphs of the LibreOffice help (MPL-2.0) in English and German, each
labelled by the module whose help holds it: Writer, Calc, Impress, Draw, Base, Math, Chart,
Basic. Paragraphs of at least 4 words; one found under two modules is dropped. Split by a stable
hash of the English text (test and validation 10% each), a paragraph and its translation always
in the same split."""


class OfflineHelpTopics(tfds.core.GeneratorBasedBuilder):
    """Help paragraph -> LibreOffice module, English and German."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Help paragraphs of 8 modules, en and de, hash splits."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = de_en.MANUAL_DOWNLOAD_INSTRUCTIONS  # same packages

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=_DESCRIPTION,
            features=tfds.features.FeaturesDict({
                "text": tfds.features.Text(),
                "label": tfds.features.ClassLabel(names=help_paragraphs.LABELS),
                "language": tfds.features.Text(),
            }),
            supervised_keys=("text", "label"),
            homepage="https://packages.debian.org/bookworm/libreoffice-help-en-us",
            metadata=tfds.core.MetadataDict(),
            license="LibreOffice help: MPL-2.0 (files in licenses/)",
        )

    def _split_generators(self, dl_manager):
        root, packages = de_en.unpacked_root(dl_manager)
        splits = help_paragraphs.split_examples(help_paragraphs.labelled_pairs(root))
        if not splits["train"]:
            raise FileNotFoundError(f"{root} holds no help pages of the modules "
                                    f"{', '.join(help_paragraphs.MODULES)}")
        self.info.metadata.update({
            "packages": packages,
            "examples": {name: len(examples) for name, examples in splits.items()},
            "labels": {name: dict(collections.Counter(
                help_paragraphs.LABELS[e["label"]] for e in examples))
                for name, examples in splits.items()},
            "split_rule": "sha256 of the NFKC-casefolded English text: test < 10%, validation "
                          "next 10%",
        })
        debian.copy_licences(root, corpus.PACKAGES, os.fspath(self.data_dir))
        return {name: self._generate_examples(examples) for name, examples in splits.items()}

    def _generate_examples(self, examples):
        yield from enumerate(examples)
