"""The repository's docs stand alone: no file points at design notes that live outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Notes kept outside this repository while it was written; a reader of the repo cannot open them.
OUTSIDE = re.compile(
    r"SGLANG_MAP|ALGORITHMS(\.md|\s+\d)|ARCHITECTURE\.md|ENVIRONMENT\.md|ANCHORS\.md|shared/design"
)


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [ROOT / f for f in out.splitlines()]
    return [
        f for f in files if f.suffix in {".py", ".md", ".toml", ".txt", ".cfg", ".sh", ".yml", ".yaml", ""}
    ]


def test_no_reference_to_notes_outside_the_repo():
    hits = []
    this = Path(__file__).resolve()
    for f in tracked_text_files():
        if f.resolve() == this or not f.is_file():
            continue
        text = f.read_text(errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "references to notes outside the repo:\n" + "\n".join(hits)


def test_markdown_links_resolve_inside_the_repo():
    """Every relative `*.md` file a tracked markdown file names exists in the repo."""
    missing = []
    for f in tracked_text_files():
        if f.suffix != ".md":
            continue
        for target in re.findall(r"\]\(([^)#:\s]+\.md)\)", f.read_text(errors="replace")):
            if not (f.parent / target).exists():
                missing.append(f"{f.relative_to(ROOT)} -> {target}")
    assert not missing, missing
