"""The documentation as a reader meets it: the README is a landing page whose figures are in the
records its results pages link, the Python examples run, the API reference covers the public
API, and nothing points at a file outside the repository."""

import gzip
import json
import os
import pathlib
import re
import subprocess
import sys

import transformer

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
EXAMPLE_PAGES = ("README.md", "docs/research-api.md")


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


def test_examples_run(untrained_translation_workdir, untrained_lm_workdir):
    """Every Python block of the README and the research API page; the trained runs they load
    are untrained runs of the same kinds (a vision run's example needs an image: left out)."""
    runs = {'"runs/default"': untrained_translation_workdir,
            '"runs/lm_default"': untrained_lm_workdir}
    ran = 0
    for page in EXAMPLE_PAGES:
        for block in python_blocks(page):
            for name, workdir in runs.items():
                block = block.replace(name, repr(str(workdir)))
            if '"runs/' in block:
                continue
            exec(compile(block, page, "exec"), {})
            ran += 1
    assert ran >= 20


RECORD = re.compile(r"(?:records|table3)/[\w.-]+(?:/[\w.-]+)*")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
FIGURE = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s*(%|ms|min|s\b)?")
# The scales a record may write a figure in, by the unit after it in the README: a fraction
# shown as a percentage, seconds as milliseconds and back, seconds as minutes.
SCALES = {"%": (1, 100), "ms": (1, 1e3), "s": (1, 1e-3), "min": (1, 1 / 60)}
# A README label's word -> the metric key a record writes it under (else the word itself).
KEYS = {"sacrebleu": "bleu", "compound-split": "bleu_tok_compound"}


def linked_records(page: pathlib.Path) -> list[pathlib.Path]:
    """The record files a results page links (`records/<study>/...`, `table3/results.json`,
    relative to the page or to docs/; a folder stands for the files in it)."""
    found = []
    for path in RECORD.findall(page.read_text()):
        for base in (page.parent, ROOT / "docs"):
            target = base / path.rstrip(".")
            if target.is_file():
                found.append(target)
            elif target.is_dir():
                found.extend(f for f in sorted(target.rglob("*")) if f.is_file())
    return list(dict.fromkeys(found))


def record_entries(path: pathlib.Path) -> list[dict | str]:
    """A record as its JSON objects (a .json list or object, one per line of a .jsonl), else
    its text."""
    data = path.read_bytes()
    text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode(errors="replace")
    try:
        parsed = json.loads(text)
        return parsed if isinstance(parsed, list) else [parsed]
    except json.JSONDecodeError:
        pass
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError:
        return [text]


def candidates(entries: list[dict | str], words: set[str], qualifiers: set[str]) -> list[float]:
    """The numbers a figure labelled by `words` may be: in a JSON object whose string values
    include every qualifier (e.g. "test", "base"), those under the label's keys (all of the
    object's where the label names none); in a text record, every number."""
    numbers = []
    for entry in entries:
        if isinstance(entry, str):
            numbers += [float(n.replace(",", "")) for n in NUMBER.findall(entry)]
            continue
        if not isinstance(entry, dict):
            continue
        strings = {str(v).lower() for v in entry.values() if isinstance(v, str)}
        if not qualifiers <= strings:
            continue
        keys = {KEYS.get(w, w) for w in words} & set(entry)
        numbers += [float(v) for k, v in entry.items() if (k in keys or not keys)
                    and isinstance(v, int | float) and not isinstance(v, bool)]
    return numbers


def shown_in(figure: str, unit: str, numbers: list[float]) -> bool:
    """Whether a record number, in one of the unit's scales, rounds to `figure` as shown
    (thousands separators dropped, to the figure's decimal places)."""
    value = float(figure.replace(",", ""))
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    half = 0.5 * 10.0 ** -decimals * (1 + 1e-9)
    return any(abs(n * scale - value) <= half for n in numbers
               for scale in SCALES.get(unit, (1,)))


def figures_missing_from_records(what: str, figure: str, page: pathlib.Path) -> list[str]:
    """Each figure of a README row (its cell `figure`) that no record of `page` holds: the
    words before a figure name its metric, and those that are a record's string values
    (e.g. "test", "base") choose its objects for every later figure of the row."""
    records = linked_records(page)
    entries = [e for record in records for e in record_entries(record)]
    values = {str(v).lower() for e in entries if isinstance(e, dict) for v in e.values()
              if isinstance(v, str)}
    name = page.relative_to(ROOT)
    missing = []
    qualifiers = set()
    last = 0
    for match in FIGURE.finditer(figure):
        words = {w.strip("(),:;").lower() for w in figure[last:match.start()].split()} - {""}
        qualifiers |= words & values
        last = match.end()
        shown = match.group(0).strip()
        if not records:
            missing.append(f"{what}: {shown}: {name} links no record")
        elif not shown_in(match.group(1), match.group(2) or "",
                          candidates(entries, words - values, qualifiers)):
            missing.append(f"{what}: {shown} ({' '.join(sorted(words))}) is in none of "
                           f"{[str(r.relative_to(ROOT)) for r in records]}")
    return missing


def test_readme_is_a_landing_page_whose_figures_are_in_their_records():
    """At most ~200 lines; each results row links a results page, and each figure of the row
    is in a record that page links (records/..., table3/results.json), opened and read: under
    the metric its label names, in the objects its qualifiers choose ("test", "base"), as
    shown or rounded to the digits shown, in a scale its unit allows."""
    assert len(README.splitlines()) <= 200
    table = README.split("## Results", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    assert 3 <= len(rows) <= 6, rows
    missing = []
    for row in rows:
        what, figure, where = (cell.strip() for cell in row.strip("|").split("|"))
        page = re.search(r"\]\((docs/results/[^)]+\.md)\)", where)
        assert page, f"{what}: no results page linked"
        missing += figures_missing_from_records(what[:40], figure, ROOT / page.group(1))
    assert not missing, "\n".join(missing)


def test_api_reference_covers_the_public_api():
    documented = set()
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        documented |= set(re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M))
    for name in transformer.__all__:
        obj = getattr(transformer, name)
        qualified = f"{obj.__module__}.{obj.__name__}"
        assert qualified in documented or obj.__module__ in documented, name


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    texts = [f for f in files if f.endswith((".py", ".md", ".sh", ".toml", ".yml", "Makefile"))
             and f != "tests/test_docs.py"]
    outside = [f for f in texts
               if re.search(r"DESIGN\.md|\.\./shared|shared/notes|shared/scripts",
                            (ROOT / f).read_text())]
    assert not outside


def test_site_builds_strict_and_renders_every_table_and_image(tmp_path):
    """`mkdocs build --strict` (no broken link, page, anchor or docstring), and every table and
    image a page writes in Markdown is a <table> and an <img> in its HTML."""
    site = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                           cwd=ROOT, capture_output=True, text=True,
                           env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})  # as `make docs` does
    assert build.returncode == 0, build.stderr[-3000:]
    for page in (ROOT / "docs").rglob("*.md"):
        name = page.relative_to(ROOT / "docs")
        if name.parts[0] in ("hooks", "reference"):  # the reference's tables are generated
            continue
        source = README if name.as_posix() == "index.md" else page.read_text()
        source = re.sub(r"```.*?```", "", source, flags=re.S)
        html = (site / name.with_suffix("") / "index.html" if name.stem != "index"
                else site / name.parent / "index.html").read_text()
        tables = len(re.findall(r"^\s*\|?\s*:?-{3,}:?\s*\|", source, flags=re.M))
        assert html.count("<table") == tables, f"{name}: {tables} tables written"
        assert len(re.findall(r"<img ", html)) == source.count("!["), f"{name}: images"
