"""The documentation as a reader meets it: the README is a landing page whose figures come from
the results pages, the Python examples run, the API reference covers the public API, and nothing
points at a file outside the repository."""

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


def test_readme_is_a_landing_page_whose_figures_link_their_records():
    """At most ~200 lines; each results row links a results page that holds its figures."""
    assert len(README.splitlines()) <= 200
    table = README.split("## Results", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    assert 3 <= len(rows) <= 6, rows
    for row in rows:
        what, figure, where = (cell.strip() for cell in row.strip("|").split("|"))
        page = re.search(r"\]\((docs/results/[^)]+\.md)\)", where)
        assert page, f"{what}: no results page linked"
        text = (ROOT / page.group(1)).read_text()
        for number in re.findall(r"\d[\d,.]*\d|\d", figure):
            assert number in text, f"{what}: {number} is not in {page.group(1)}"


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
                           cwd=ROOT, capture_output=True, text=True)
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
