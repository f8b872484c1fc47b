"""TFDS dataset `offline_de_en`: the offline German-English corpus (`corpus`) as a TFDS
builder, English -> German like the paper.

Importing this module registers the builder, so `tfds.builder("offline_de_en")`,
`tfds.load("offline_de_en", download=False)` and `tfds.data_source(...)` find it. The first
`download_and_prepare` fetches the three Debian packages with `apt-get download` into
`<data_dir>/downloads/offline_de_en/` and unpacks them there with `dpkg-deb -x` (nothing is
installed). A `manual_dir` holding an already unpacked tree (`usr/share/libreoffice/help/...`,
`usr/share/trans/de-en`) is used instead (the tests' fixture). The package versions and .deb
sha256 are in `info.metadata`. The packages' copyright files are copied to
`<dataset dir>/licenses/`.
"""

from __future__ import annotations

import os

import tensorflow_datasets as tfds

from transformer.data.offline import corpus, debian

_DESCRIPTION = """Real German-English translations built offline from Debian packages: the
LibreOffice help pages (MPL-2.0), paragraphs aligned by their ids, and the sentence pairs of the
Ding dictionary (GPL-2+). Deduplicated; split by a stable hash of the normalised English side
(test about 4% and at least 2,000 pairs, validation about 2%)."""


def unpacked_root(dl_manager) -> tuple[str, list[dict]]:
    """The unpacked packages (a manual_dir's tree, else fetched once into the download dir,
    shared by the builders that read them) and the packages' records."""
    return debian.unpacked_root(dl_manager, corpus.PACKAGES, cache="offline_de_en",
                                marker="usr", dataset="offline_de_en",
                                alternative=corpus.WMT_HINT)


MANUAL_DOWNLOAD_INSTRUCTIONS = f"""Optional. Without a manual_dir the builder runs
    `apt-get download {' '.join(corpus.PACKAGES)}` itself. A
    manual_dir may hold the packages already unpacked with `dpkg-deb -x` (usr/share/...)."""


class OfflineDeEn(tfds.core.GeneratorBasedBuilder):
    """English -> German sentence pairs from LibreOffice help and the Ding dictionary."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "LibreOffice help paragraphs by id + Ding sentence pairs."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = MANUAL_DOWNLOAD_INSTRUCTIONS

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=_DESCRIPTION,
            features=tfds.features.Translation(languages=("en", "de")),
            supervised_keys=("en", "de"),
            homepage="https://packages.debian.org/bookworm/libreoffice-help-de",
            metadata=tfds.core.MetadataDict(),
            license="LibreOffice help: MPL-2.0; Ding dictionary: GPL-2+ (files in licenses/)",
        )

    def _split_generators(self, dl_manager):
        root, packages = unpacked_root(dl_manager)
        splits = corpus.corpus_pairs(root)
        self.info.metadata.update({
            "packages": packages,
            "pairs": {name: len(pairs) for name, pairs in splits.items()},
            "split_rule": "sha256 of the NFKC-casefolded English side: test < 4% (>= 2000 "
                          "pairs), validation next 2%",
        })
        debian.copy_licences(root, corpus.PACKAGES, os.fspath(self.data_dir))
        return {name: self._generate_examples(pairs) for name, pairs in splits.items()}

    def _generate_examples(self, pairs):
        for index, (en, de) in enumerate(pairs):
            yield index, {"en": en, "de": de}
