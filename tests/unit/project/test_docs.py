"""The documentation: the generated references are current, every relative link and #anchor in
README.md and docs/*.md resolves, and README stays a front door."""

from __future__ import annotations

import re
from pathlib import Path

from elasticd.ops import docs
from harness import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where a link is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation dropped
    (letters, digits, '_', '-' and spaces kept), each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page's headings make; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_is_githubs():
    assert (
        slug("Control plane at scale (`bench/scale.py`)") == "control-plane-at-scale-benchscalepy"
    )
    assert (
        slug("In-memory state: lose a step, not a checkpoint interval")
        == "in-memory-state-lose-a-step-not-a-checkpoint-interval"
    )
    assert (
        slug("Traps in torch's elastic pieces (torch 2.13) to design around")
        == "traps-in-torchs-elastic-pieces-torch-213-to-design-around"
    )
    assert slug("etcd operations (`bench/etcd_kv.py`)") == "etcd-operations-benchetcd_kvpy"


def test_generated_references_are_current():
    stale = docs.stale(ROOT)
    assert not stale, f"{', '.join(stale)} not current: run {docs.REGENERATE}"


def test_every_relative_link_and_anchor_resolves():
    bad = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists() or not dest.is_relative_to(ROOT):
                bad.append(f"{where} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                bad.append(f"{where} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_every_docs_page_is_linked_from_readme():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"](docs/{page.name}" in readme, f"README links no docs/{page.name}"


def test_readme_is_a_front_door_with_cis_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200, (
        "README.md is a front door: move the details to a docs/ page"
    )
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    (line,) = [line for line in ci if line.startswith("README_TESTS=")]
    command = line.removeprefix("README_TESTS=").strip("'")
    assert 'bash -c "$README_TESTS"' in ci, "CI runs the command it names"
    assert f"Run the tests:\n\n```\n{command}\n```\n" in readme
