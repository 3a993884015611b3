"""Every relative link in README.md and docs/*.md points to a file that exists, and an anchor to a
heading of that file (GitHub's slugs); a section cited by name (`docs/X.md, "Heading"`) is a heading or a bold item there."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = sorted(
    p for d in ("diffrl", "benchmarks") for ext in ("py", "yaml") for p in (ROOT / d).rglob(f"*.{ext}")
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITED = re.compile(r"(?:docs/)?([a-z_]+\.md),? \"([^\"]+)\"")


def _slug(heading):
    text = re.sub(r"[`*]|\[|\]\([^)]*\)", "", heading).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _headings(path):
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            lines.append(line.lstrip("#").strip())
    return lines


def _anchors(path):
    seen, anchors = {}, set()
    for heading in _headings(path):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _prose(path):
    """The page without its fenced code blocks."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return "\n".join(out)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.name}: {broken}"


def _missing_sections(page):
    text = _prose(page) if page.suffix == ".md" else re.sub(r"\n\s*#?\s*", " ", page.read_text())
    missing = []
    for file, section in CITED.findall(text.replace("\n", " ")):
        dest = ROOT / "docs" / file
        if not dest.exists():
            continue
        named = any(h.startswith(section) for h in _headings(dest)) or f"**{section}" in _prose(dest)
        if not named:
            missing.append(f'{page.relative_to(ROOT)}: {file}, "{section}"')
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_sections_cited_by_name_exist(page):
    assert not _missing_sections(page)


def test_sections_cited_by_name_in_code_and_presets_exist():
    assert not [m for page in SOURCES for m in _missing_sections(page)]


def test_every_test_docs_name_exists():
    """docs/reliability.md (and every page) proves its guarantees by naming tests: each named test
    file exists and holds each named test function (`tests/x.py::name`, and a `::name` later on the
    same line, which names a test of the file named last)."""
    span = re.compile(r"`(tests/[\w/]+\.py)?(?:::(\w+))?[^`]*`")
    missing = []
    for page in PAGES:
        for line in page.read_text().splitlines():
            file = None
            for path, name in span.findall(line):
                if path:
                    file = ROOT / path
                    if not file.is_file():
                        missing.append(f"{page.name}: {path}")
                        file = None
                        continue
                if name and file is not None and f"def {name}" not in file.read_text():
                    missing.append(f"{page.name}: {file.relative_to(ROOT)}::{name}")
    assert not missing, missing
