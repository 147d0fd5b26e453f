"""Pointers into the docs stay true: a docstring or comment that sends the reader to
`docs/X.md, "Some heading"` names a document that exists and a heading (or a bold paragraph
lead) in it, and every relative link between documents names a file that exists. A section
renamed or moved to docs/experiments/ otherwise leaves readers at a dead end."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("operator/diloco_operator", "trainer/diloco_trainer")
# `docs/design.md, "Trust no single unit"`, the quoted title possibly wrapped over lines
# (with a comment's `#` at the start of the continuation).
REFERENCE = re.compile(r'(docs/[\w/.-]+\.md),\s*(?:#\s*)?"([^"]+)"')
LINK = re.compile(r"\]\(((?!https?:|#|mailto:)[^)#\s]+)(?:#[^)]*)?\)")


def _titles(doc: Path) -> list[str]:
    """Headings and bold paragraph leads (`**Interleaved shards.**`), lower-cased."""
    text = doc.read_text()
    heads = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    leads = re.findall(r"^\*\*([^*]+)\*\*", text, flags=re.MULTILINE)
    return [t.lower() for t in heads + leads]


def dangling_references(sources: list[Path]) -> list[str]:
    found = []
    for path in sources:
        for doc, title in REFERENCE.findall(path.read_text()):
            title = re.sub(r"\s*\n\s*#?\s*", " ", title).strip().lower()
            target = ROOT / doc
            if not target.exists():
                found.append(f"{path.name}: {doc} does not exist")
            elif not any(title in t for t in _titles(target)):
                found.append(f"{path.name}: no section {title!r} in {doc}")
    return found


def test_code_points_at_sections_that_exist() -> None:
    sources = [p for s in SOURCES for p in sorted((ROOT / s).rglob("*.py"))]
    assert len(sources) > 100
    assert dangling_references(sources) == []


def test_a_renamed_section_is_caught(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text('"""See docs/design.md, "A heading nobody wrote"."""\n')
    assert len(dangling_references([planted])) == 1


def test_links_between_documents_name_files_that_exist() -> None:
    # docs/bench/*.md are parts of docs/benchmarks.md and link from there.
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    docs = [d for d in docs if d.parent.name != "bench"]
    broken = [
        f"{doc.relative_to(ROOT)} -> {target}"
        for doc in docs
        for target in LINK.findall(doc.read_text())
        if not (doc.parent / target).exists()
    ]
    assert broken == []
