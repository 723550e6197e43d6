"""The repository's docs stand alone: no file points at design notes that live outside it."""

from __future__ import annotations

import importlib.util
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


# -- the docs site: README.md (the front page) and docs/ --------------------------------------------

README_MAX_LINES = 350
# Front page, docs pages and the two indexes next to them: every relative link and quoted command in
# these must point at something that exists, so a reader never follows a stale path.
LINKED_PAGES = [
    "README.md",
    "CHANGELOG.md",
    "results/README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
# Leading `VAR=value` assignments and `nice -n N` are stripped before a command is recognised.
PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:nice\s+-n\s+\d+\s+)?")
COMMAND = re.compile(
    r"^(?:make\s+(?P<make>[A-Za-z0-9_.-]+)"
    r"|(?:\$PY|python3?)\s+(?P<script>benchmarks/[\w/.-]+\.py)"
    r"|(?:\$PY|python3?)\s+-m\s+(?P<module>sgl_kvevict(?:\.\w+)*)"
    r"|bash\s+(?P<shell>scripts/[\w/.-]+))"
)


def _pages() -> list[Path]:
    return [ROOT / p for p in LINKED_PAGES if (ROOT / p).is_file()]


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {
        m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+):(?!=)", text, re.M) if m.group(1) != ".PHONY"
    }


def quoted_commands(text: str) -> list[str]:
    """Commands a page tells the reader to run: lines of ``` blocks, and inline `code` spans."""
    lines = [ln.strip() for block in FENCE.findall(text) for ln in block.splitlines()]
    lines += [span.strip() for span in INLINE.findall(FENCE.sub("", text))]
    return [PREFIX.sub("", ln) for ln in lines if ln]


def command_problem(cmd: str, targets: set[str]) -> str | None:
    """Why `cmd` names something that does not exist, or None (also None for commands not checked)."""
    m = COMMAND.match(cmd)
    if not m:
        return None
    name = next(v for v in m.groupdict().values() if v)
    if re.fullmatch(r"[A-Z]", re.split(r"[./]", name.removesuffix(".py").removesuffix(".sh"))[-1]):
        return None  # a placeholder in prose (`make X`, `python -m sgl_kvevict.X`)
    if m["make"]:
        return None if m["make"] in targets else f"no Make target {m['make']!r}"
    if m["script"]:
        return None if (ROOT / m["script"]).is_file() else f"no file {m['script']}"
    if m["shell"]:
        return None if (ROOT / m["shell"]).is_file() else f"no file {m['shell']}"
    try:
        found = importlib.util.find_spec(m["module"]) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"no module {m['module']}"


def test_readme_is_a_front_page():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}); move sections to docs/"
    )


def test_every_docs_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f": {p.name}" not in nav]
    assert not missing, f"docs pages missing from mkdocs.yml nav: {missing}"


def test_relative_links_in_docs_resolve():
    """Every relative link (pages, results/ files, images) in README.md and docs/ names an existing file."""
    missing = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, "links to missing files:\n" + "\n".join(missing)


def test_commands_quoted_in_docs_exist():
    """`make X`, `python benchmarks/X.py`, `python -m sgl_kvevict.X`, `bash scripts/X` name real things."""
    targets = _make_targets()
    bad, checked = [], 0
    for page in _pages():
        for cmd in quoted_commands(page.read_text()):
            checked += COMMAND.match(cmd) is not None
            why = command_problem(cmd, targets)
            if why:
                bad.append(f"{page.relative_to(ROOT)}: {cmd[:100]}: {why}")
    assert checked >= 20, f"only {checked} commands recognised: has the quoting style changed?"
    assert not bad, "commands in docs that name nothing:\n" + "\n".join(bad)


def test_command_check_catches_stale_names():
    """The checker itself: stale names of each kind are reported, real ones pass."""
    targets = _make_targets()
    assert command_problem("make test", targets) is None
    assert command_problem("make no-such-target", targets)
    assert command_problem("python benchmarks/bench_server.py --budget 512", targets) is None
    assert command_problem("python benchmarks/no_such_bench.py", targets)
    assert command_problem("python -m sgl_kvevict.launch --kv-policy lagkv", targets) is None
    assert command_problem("python -m sgl_kvevict.no_such_module", targets)
    assert command_problem("bash scripts/env.sh", targets) is None
    assert command_problem("bash scripts/no_such.sh", targets)
    assert command_problem("python -m sgl_kvevict.X", targets) is None  # a placeholder
    assert command_problem("python -m sgl_kvevict.plugin", targets)  # moved to sgl_kvevict.serve.plugin
    assert quoted_commands("x `HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/a.py` y") == [
        "python benchmarks/a.py"
    ]


REPO_PATH = re.compile(
    r"(?<![\w/.])((?:sgl_kvevict|kernels|policies|benchmarks|scripts|tests|scenarios|requirements)/[\w/.-]+\.(?:py|sh|txt))"
)


def test_repo_paths_quoted_in_docs_exist():
    """Module and script paths named in `code` spans (e.g. `sgl_kvevict/cache/engine.py`) exist, so a
    file that moves leaves no stale path behind. Placeholders (`benchmarks/X.py`) are skipped."""
    missing = []
    for page in _pages():
        for span in INLINE.findall(FENCE.sub("", page.read_text())):
            for path in REPO_PATH.findall(span):
                if re.fullmatch(r"[A-Z]", Path(path).stem) or (ROOT / path).exists():
                    continue
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths in docs that do not exist:\n" + "\n".join(missing)


def _slugs(page: Path) -> set[str]:
    """The anchors a page's headings get, as mkdocs (the site) and GitHub (the repository view) write them."""
    out = set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*$", FENCE.sub("", page.read_text()), re.M):
        text = re.sub(r"[^\w\s-]", "", title.replace("`", "")).strip().lower()
        out.add(re.sub(r"[-\s]+", "-", text))  # mkdocs' toc slugify
        out.add(re.sub(r"\s", "-", text))  # GitHub: every space a hyphen, hyphens kept
    return out


def broken_anchors(pages: list[Path], root: Path = ROOT) -> list[str]:
    """`page -> target#anchor` for each link whose anchor no heading of its target page gives."""
    bad = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "#" not in target or re.match(r"^[a-z]+:", target):
                continue
            path, anchor = target.split("#", 1)
            dest = (page.parent / path) if path else page
            if dest.suffix == ".md" and dest.is_file() and anchor not in _slugs(dest):
                bad.append(f"{page.relative_to(root)} -> {target}")
    return bad


def test_anchors_in_docs_links_resolve():
    """A link to `page.md#section` (the README's to benchmarks.md, above all) names a heading of that page."""
    bad = broken_anchors(_pages())
    assert not bad, "links to headings that do not exist:\n" + "\n".join(bad)


def test_anchor_check_catches_a_stale_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Host tier and recall (`benchmarks/replay.py --scenarios recall`)\n")
    (tmp_path / "b.md").write_text(
        "[x](a.md#host-tier-and-recall-benchmarksreplaypy-scenarios-recall) [y](a.md#the-cost-of-recall)\n"
    )
    assert broken_anchors([tmp_path / "b.md"], tmp_path) == ["b.md -> a.md#the-cost-of-recall"]
