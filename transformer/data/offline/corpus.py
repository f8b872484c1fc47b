"""The offline German-English corpus: real human translations from three Debian packages.

`apt-get download libreoffice-help-de libreoffice-help-en-us trans-de-en` fetches the .deb files
(about 11 MB; it needs Debian package lists, i.e. `apt-get update` once, but installs nothing),
`dpkg-deb -x` unpacks them into a cache directory (`debian.py` beside it), and this module turns the
unpacked trees into sentence pairs:

- LibreOffice help (MPL-2.0): `usr/share/libreoffice/help/{de,en-US}/**.html` hold the same pages
  at the same relative paths. Paragraphs (`p`, `h`, `h1`-`h6`, `td`) carry the same ids
  (`par_id…`, `hd_id…`) in both languages. Text inside `hidden` elements is skipped, except the
  `default…` variants of platform switches (what a non-Mac reader sees).
- The Ding dictionary (GPL-2+): `usr/share/trans/de-en`, lines `DE :: EN` whose senses (` | `) and
  variants (`; `) align. Entries that are sentences on both sides (capital first, `.!?` last, at
  least 3 words) are kept.

Pairs are deduplicated, untranslated (identical) pairs dropped, and split by a stable hash of the
normalised English side (`split_of`), so a sentence never crosses splits. The TFDS builder over
this is `transformer.data.offline.de_en`. Pure Python: no TensorFlow here.
"""

from __future__ import annotations

import glob
import hashlib
import html.parser
import math
import os
import re
import unicodedata

PACKAGES = ("libreoffice-help-de", "libreoffice-help-en-us", "trans-de-en")
HELP_DIR = "usr/share/libreoffice/help"
DING_FILE = "usr/share/trans/de-en"
TEST_FRACTION = 0.04
MIN_TEST_PAIRS = 2000
MAX_TEST_FRACTION = 0.10
VALIDATION_FRACTION = 0.02
WMT_HINT = "or train on WMT instead (configs/wmt14_ende_base.py; docs/data.md)"


# --------------------------------------------------------------------------- LibreOffice help

_PARAGRAPH_TAGS = {"p", "h", "h1", "h2", "h3", "h4", "h5", "h6", "td"}
_ID = re.compile(r"^(par|hd)_id")
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
         "track", "wbr"}
_SPACES = re.compile(r"\s+")


class _HelpPage(html.parser.HTMLParser):
    """Collects {paragraph id: [texts]} of one help page, skipping hidden text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: dict[str, list[str]] = {}
        self._stack: list[tuple[str, str | None, bool]] = []  # (tag, captured id, hidden)
        self._open: dict[str, list[str]] = {}  # id -> text pieces, while inside it
        self._hidden = 0

    def handle_starttag(self, tag, attrs):
        if tag in _VOID:
            return
        attrs = dict(attrs)
        element_id = attrs.get("id") or ""
        hidden = "hidden" in attrs and not element_id.startswith("default")
        captured = element_id if tag in _PARAGRAPH_TAGS and _ID.match(element_id) else None
        if captured is not None and captured in self._open:
            captured = None  # the same id nested in itself: one capture
        self._stack.append((tag, captured, hidden))
        self._hidden += hidden
        if captured is not None:
            self._open[captured] = []

    def handle_endtag(self, tag):
        if tag in _VOID or not any(t == tag for t, _, _ in self._stack):
            return
        while self._stack:  # close implicitly ended elements up to the matching one
            open_tag, captured, hidden = self._stack.pop()
            self._hidden -= hidden
            if captured is not None:
                text = _SPACES.sub(" ", "".join(self._open.pop(captured))).strip()
                if text:
                    self.paragraphs.setdefault(captured, []).append(text)
            if open_tag == tag:
                break

    def handle_data(self, data):
        if not self._hidden:
            for pieces in self._open.values():
                pieces.append(data)


def help_paragraphs(path: str) -> dict[str, list[str]]:
    parser = _HelpPage()
    with open(path, encoding="utf-8") as f:
        parser.feed(f.read())
    parser.close()
    return parser.paragraphs


def help_page_pairs(root: str, subdirectory: str = "") -> list[tuple[str, list]]:
    """(page path relative to the English help, its (en, de) paragraph pairs) for every page
    under `<help>/en-US/<subdirectory>` that exists in both languages, in a stable order.
    Paragraphs pair by their ids."""
    en_dir, de_dir = (os.path.join(root, HELP_DIR, lang) for lang in ("en-US", "de"))
    pages = []
    pattern = os.path.join(en_dir, subdirectory, "**", "*.html")
    for en_path in sorted(glob.glob(pattern, recursive=True)):
        relative = os.path.relpath(en_path, en_dir)
        de_path = os.path.join(de_dir, relative)
        if not os.path.exists(de_path):
            continue
        en = help_paragraphs(en_path)
        de = help_paragraphs(de_path)
        pages.append((relative, [pair for key in en if key in de and len(en[key]) == len(de[key])
                                 for pair in zip(en[key], de[key], strict=True)]))
    return pages


def libreoffice_pairs(root: str) -> list[tuple[str, str]]:
    """(en, de) pairs from the help pages present in both languages, in a stable order."""
    return [pair for _, pairs in help_page_pairs(root) for pair in pairs]


# --------------------------------------------------------------------------- Ding dictionary

_ANNOTATION = re.compile(r"\{[^}]*\}|\[[^\]]*\]|<[^>]*>")
_SPACE_BEFORE_PUNCTUATION = re.compile(r"\s+([.,;:!?])")


def _clean(text: str) -> str:
    text = _SPACES.sub(" ", _ANNOTATION.sub("", text)).strip()
    return _SPACE_BEFORE_PUNCTUATION.sub(r"\1", text)


def _is_sentence(text: str) -> bool:
    return len(text.split()) >= 3 and text[:1].isupper() and text[-1:] in ".!?"


def ding_pairs(path: str) -> list[tuple[str, str]]:
    """(en, de) sentence pairs of the Ding dictionary file (`DE :: EN` lines)."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") or " :: " not in line:
                continue
            de_side, en_side = line.rstrip("\n").split(" :: ", 1)
            de_senses = de_side.split(" | ")
            en_senses = en_side.split(" | ")
            if len(de_senses) != len(en_senses):
                continue
            for de_sense, en_sense in zip(de_senses, en_senses, strict=True):
                de_variants = de_sense.split("; ")
                en_variants = en_sense.split("; ")
                if len(de_variants) != len(en_variants):
                    continue
                for de, en in zip(de_variants, en_variants, strict=True):
                    de, en = _clean(de), _clean(en)
                    if _is_sentence(de) and _is_sentence(en):
                        pairs.append((en, de))
    return pairs


# --------------------------------------------------------------------------- pairs and splits


def normalise(text: str) -> str:
    """The key of the split hash: NFKC, case-folded, whitespace collapsed."""
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def hash_unit(text: str) -> float:
    """A stable number in [0, 1) from the normalised text (sha256, not Python's hash)."""
    digest = hashlib.sha256(normalise(text).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def deduplicate(pairs) -> list[tuple[str, str]]:
    """Drops untranslated pairs (both sides equal) and repeats, keeping the first."""
    seen = set()
    kept = []
    for en, de in pairs:
        if en == de or (en, de) in seen or not en or not de:
            continue
        seen.add((en, de))
        kept.append((en, de))
    return kept


def split_thresholds(units: list[float]) -> tuple[float, float]:
    """Hash thresholds (test, validation): test is u < t_test (4%, raised to hold at least
    2,000 pairs where that is at most 10% of the corpus), validation t_test <= u < t_val (2%)."""
    t_test = TEST_FRACTION
    wanted = min(MIN_TEST_PAIRS, math.floor(MAX_TEST_FRACTION * len(units)))
    if wanted and sum(u < t_test for u in units) < wanted:
        t_test = sorted(units)[wanted - 1] + 1e-12
    return t_test, t_test + VALIDATION_FRACTION


def split_pairs(pairs) -> dict[str, list[tuple[str, str]]]:
    """{"train", "validation", "test"} by the stable hash of the normalised English side."""
    units = [hash_unit(en) for en, _ in pairs]
    t_test, t_val = split_thresholds(units)
    splits = {"train": [], "validation": [], "test": []}
    for pair, u in zip(pairs, units, strict=True):
        splits["test" if u < t_test else "validation" if u < t_val else "train"].append(pair)
    return splits


def corpus_pairs(root: str) -> dict[str, list[tuple[str, str]]]:
    """The whole corpus under an unpacked root, split. Either source may be absent (the test
    fixture has only LibreOffice help pages)."""
    pairs = []
    if os.path.isdir(os.path.join(root, HELP_DIR)):
        pairs += libreoffice_pairs(root)
    if os.path.exists(os.path.join(root, DING_FILE)):
        pairs += ding_pairs(os.path.join(root, DING_FILE))
    if not pairs:
        raise FileNotFoundError(f"{root} holds neither {HELP_DIR} nor {DING_FILE}")
    return split_pairs(deduplicate(pairs))
