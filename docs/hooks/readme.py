"""MkDocs hook: the site's home page is the README, its `docs/` links made relative to the site
(one text for GitHub's front page and the site's)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "index.md":
        return markdown
    text = README.read_text()
    return re.sub(r"\]\(docs/", "](", text)
