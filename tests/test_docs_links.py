"""Every relative link in README.md and docs/*.md names a file inside the repository, so
that a clone holds every document it links (issue 37: the README linked
``../shared/DESIGN.md``, outside the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", re.I)


def relative_links(text: str) -> list[str]:
    """The link targets of a Markdown text that name a file (no URL, no in-page anchor),
    fragments dropped; code blocks are not Markdown, so their brackets are skipped."""
    text = FENCE.sub("", text)
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [t.split("#", 1)[0] for t in targets if not EXTERNAL.match(t)]


def test_the_link_parser_finds_relative_links_only():
    text = ("See [a](docs/A.md#part), [`b`](../shared/B.md), [c](https://x.org/c.md),\n"
            "[d](#anchor), [e](mailto:x@y.z).\n```\n[f](in/code.md)\n```\n[g]: ./G.md\n")
    assert relative_links(text) == ["docs/A.md", "../shared/B.md", "./G.md"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_a_file_in_the_repository(document):
    problems = []
    for target in relative_links(document.read_text(encoding="utf-8")):
        path = (document.parent / target).resolve()
        if not path.is_relative_to(REPO):
            problems.append(f"{target}: outside the repository")
        elif not path.exists():
            problems.append(f"{target}: no such file")
    assert not problems, f"{document.relative_to(REPO)}: {problems}"
