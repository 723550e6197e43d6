"""Every stored result is cited by a doc, and every result a doc cites is stored (no server).

A `results/` folder (or top-level file) stays in the tree only while README.md or a page of docs/ cites
it: results/README.md is the index of what is kept, not a reason to keep it. A results path that a doc
names must exist, except under `results/tmp/` (ignored scratch) and a path qualified by a commit
(`55a1648:results/...`), which names what `git show` gives back. results/README.md lists exactly the
entries kept, one row each.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "results"
# Pages whose citations keep a result in the tree.
CITING = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
# Pages whose results paths must exist (the citing pages and the two indexes).
CHECKED = [*CITING, "results/README.md", "benchmarks/README.md"]
# `results/NAME[/...]`, also as `../results/...` in a link; not when a commit qualifies it (`abc1234:results/`).
CITATION = re.compile(r"(?<![\w/:.-])(?:\.\./)?results/([\w.@+-]+(?:/[\w.@+-]+)*)")
SCRATCH = "tmp"
ROW = re.compile(r"^\|\s*(`[^|]+`)\s*\|", re.M)


def citations(text: str) -> list[str]:
    """The results paths a page names, relative to `results/` ('' for the folder itself or a placeholder)."""
    return [m.group(1).rstrip(".") for m in CITATION.finditer(text)]


def stored_entries(root: Path = ROOT) -> set[str]:
    """Top-level folders and files under results/ that git does not ignore (results/README.md excluded)."""
    names = {p.name for p in (root / RESULTS).iterdir() if p.name != "README.md"}
    if not names:
        return set()
    ignored = subprocess.run(
        ["git", "check-ignore", *(f"{RESULTS}/{n}" for n in sorted(names))],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout.split()
    return names - {Path(p).name for p in ignored}


def uncited(pages: dict[str, str], stored: set[str]) -> set[str]:
    """Stored entries that no citing page names."""
    cited = {c.split("/", 1)[0] for text in pages.values() for c in citations(text)}
    return stored - cited


def dangling(pages: dict[str, str], root: Path = ROOT) -> list[str]:
    """`page: results/PATH` for each results path a page names that does not exist."""
    out = []
    for page, text in pages.items():
        for c in citations(text):
            if not c or c.split("/", 1)[0] == SCRATCH:
                continue
            if not (root / RESULTS / c).exists():
                out.append(f"{page}: results/{c}")
    return out


def indexed(text: str) -> set[str]:
    """The entries results/README.md's table has a row for (its first column: `name/`, `a/`, `b/`)."""
    return {n.strip().rstrip("/") for cell in ROW.findall(text) for n in re.findall(r"`([^`]+)`", cell)}


def _read(pages: list[str]) -> dict[str, str]:
    return {p: (ROOT / p).read_text() for p in pages if (ROOT / p).is_file()}


def test_every_stored_result_is_cited_by_a_doc():
    missing = uncited(_read(CITING), stored_entries())
    assert not missing, (
        "results/ entries no doc (README.md, docs/*.md) cites; cite them where their numbers are shown "
        f"or `git rm` them (git keeps them): {sorted(missing)}"
    )


def test_every_cited_result_exists():
    bad = dangling(_read(CHECKED))
    assert not bad, "results paths named in docs that do not exist:\n" + "\n".join(bad)


def test_results_index_lists_exactly_the_stored_entries():
    rows = indexed((ROOT / RESULTS / "README.md").read_text())
    stored = stored_entries()
    assert rows == stored, (
        f"rows without a folder: {sorted(rows - stored)}; folders without a row: {sorted(stored - rows)}"
    )


def test_the_checks_catch_a_planted_uncited_folder_and_a_dangling_citation(tmp_path):
    pages = _read(CITING)
    stored = stored_entries()
    assert uncited(pages, stored | {"planted-uncited"}) == uncited(pages, stored) | {"planted-uncited"}
    pages["docs/planted.md"] = (
        "numbers in `results/no-such-run/replay.json`, a link ![x](../results/gone/a.png)"
    )
    bad = dangling(pages)
    assert "docs/planted.md: results/no-such-run/replay.json" in bad
    assert "docs/planted.md: results/gone/a.png" in bad
    # what is not a citation of a stored result
    assert citations("`git show 55a1648:results/old-run` and `--out results/tmp/x`") == ["tmp/x"]
    assert dangling({"p": "`--out results/tmp/x`, `results/...`, `results/<folder>`"}) == []
    # the index's rows
    assert indexed("| `a/` | x |\n| `b/`, `c.md` | y |\n| folder | z |") == {"a", "b", "c.md"}
    # a folder on disk that git ignores is not a stored result
    (tmp_path / RESULTS / "tmp").mkdir(parents=True)
    (tmp_path / RESULTS / "kept").mkdir()
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("results/tmp/\n")
    assert stored_entries(tmp_path) == {"kept"}
