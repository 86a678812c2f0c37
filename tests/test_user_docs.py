"""The README stays a short front page that reaches every page of docs/, the links between the
documents resolve, and every setting is documented where users look for it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_serve.service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEVELOPERS = ROOT / "DEVELOPERS.md"
DOCS = ROOT / "docs"
# Written by `moe-serve bench report` from bench/results, not by hand: linked before it exists
GENERATED = {DOCS / "performance.md"}
MAX_BYTES = 12 * 1024
LINK = re.compile(r"\]\(([^)\s]+)\)")


def documents() -> list[Path]:
    return [README, DEVELOPERS, *sorted(DOCS.glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", [README, DEVELOPERS], ids=lambda p: p.name)
def test_front_pages_stay_short(page: Path) -> None:
    assert len(page.read_bytes()) <= MAX_BYTES


def test_the_readme_shows_a_first_request_within_its_first_60_lines() -> None:
    head = README.read_text().splitlines()[:60]
    assert any("curl " in line and "/forward" in line for line in head)


def test_the_readme_links_every_docs_page() -> None:
    linked = {(ROOT / target).resolve() for target in LINK.findall(README.read_text())}
    pages = set(DOCS.glob("*.md")) | GENERATED
    assert pages - linked == set()


@pytest.mark.parametrize("page", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_to_files_and_headings(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists() or linked in GENERATED, target
        if anchor and linked.exists():
            assert anchor in anchors(linked), target


def test_every_setting_is_documented_in_the_serving_guide() -> None:
    prefix = Settings.model_config["env_prefix"]
    text = (DOCS / "serving.md").read_text()
    names = {f"{prefix}{field}".upper() for field in Settings.model_fields}
    assert {n for n in names if f"`{n}`" not in text} == set()


@pytest.mark.parametrize("page", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_speak_of_the_product_not_of_its_making(page: Path) -> None:
    text = page.read_text()
    assert not re.search(r"\bsession\b", text, flags=re.I)
    assert not re.search(r"\b(issue|PR) #?\d+", text, flags=re.I)
    commit = r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
    if page not in GENERATED:  # the performance page names the commit of each figure it shows
        assert not re.findall(commit, text)
