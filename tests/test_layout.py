"""The package's layout is its architecture: imports point one way and modules keep their privates.

Pure and fast: reads the source with `ast`, imports nothing. Function-local imports count (they run).
The arrows (see `ALLOWED`): serve -> cache -> (policies, kernels, config); config -> policies;
tools may use anything; nothing below imports what sits above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folders installed under the package (pyproject's [tool.setuptools.package-dir]).
MAPPED = {
    "kernels": "sgl_kvevict.kernels",
    "policies": "sgl_kvevict.policies",
    "scenarios": "sgl_kvevict.scenarios",
}

# Which groups each group may import (its own always included). A group is a subpackage, or a module
# at the package's top. `launch` and `model` build the server's command line, which `serve.serverproc`
# runs; `cluster` is a command over several servers.
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "policies": {"kernels"},
    "scenarios": set(),
    "config": {"policies"},
    "cache": {"config", "policies", "kernels"},
    "serve": {"cache", "config", "policies", "kernels", "launch", "model", "cpu_compat"},
    "model": set(),
    "launch": {"model"},
    "cluster": {"serve", "launch", "model", "config"},
    "cpu_compat": set(),
    "tools": {"*"},
    "": set(),  # the package's own __init__
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for the package and the folders mapped into it."""
    out: dict[str, Path] = {}
    roots = [(ROOT / "sgl_kvevict", "sgl_kvevict")] + [(ROOT / d, pkg) for d, pkg in MAPPED.items()]
    for base, pkg in roots:
        for f in sorted(base.rglob("*.py")):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = f
    return out


MODULES = module_files()


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module an `ImportFrom` names (relative imports resolved against `importer`)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, tree: ast.Module) -> list[tuple[str, int]]:
    """(imported package module, line) for every import anywhere in the file, function bodies included.
    `from pkg import mod` counts as an import of `pkg.mod` where that is a module, else of `pkg`."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = resolve(name, node)
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.append((sub if sub in MODULES else mod, node.lineno))
    return [(m, line) for m, line in found if m in MODULES and m != name]


def parse(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))


TREES = {name: parse(name) for name in MODULES}
GRAPH = {name: imports_of(name, TREES[name]) for name in MODULES}


def group(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that returns to its start, or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if color.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in color:
                cyc = visit(m)
                if cyc:
                    return cyc
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(graph):
        if n not in color:
            cyc = visit(n)
            if cyc:
                return cyc
    return None


def test_the_package_is_found():
    for name in ("sgl_kvevict.serve.plugin", "sgl_kvevict.cache.tree", "sgl_kvevict.policies.snapkv"):
        assert name in MODULES
    assert any(GRAPH.values()), "no imports found: the parser reads nothing"


def test_find_cycle_finds_one():
    """The checker itself: a planted cycle is reported, an acyclic graph is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    graph = {n: {m for m, _ in deps} for n, deps in GRAPH.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_point_one_way():
    bad = []
    for n, deps in GRAPH.items():
        g, allowed = group(n), ALLOWED.get(group(n))
        assert allowed is not None, f"{n}: group {g!r} has no entry in ALLOWED"
        if "*" in allowed:
            continue
        for m, line in deps:
            if group(m) != g and group(m) not in allowed:
                bad.append(f"{MODULES[n].relative_to(ROOT)}:{line}: {n} ({g}) imports {m} ({group(m)})")
    assert not bad, "imports against the arrows:\n" + "\n".join(bad)


def private_uses(name: str, tree: ast.Module) -> list[str]:
    """`from mod import _x` and `mod._x` where mod is another module of the package."""
    aliases: dict[str, str] = {}  # local name -> package module it stands for
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = resolve(name, node)
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in MODULES:
                    aliases[a.asname or a.name] = sub
                elif (
                    mod in MODULES and mod != name and a.name.startswith("_") and not a.name.startswith("__")
                ):
                    hits.append(
                        f"{MODULES[name].relative_to(ROOT)}:{node.lineno}: from {mod} import {a.name}"
                    )
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and aliases.get(node.value.id, name) != name
        ):
            mod = aliases[node.value.id]
            hits.append(
                f"{MODULES[name].relative_to(ROOT)}:{node.lineno}: {node.value.id}._{node.attr[1:]} ({mod})"
            )
    return hits


def test_no_module_uses_another_modules_privates():
    hits = [h for n in MODULES for h in private_uses(n, TREES[n])]
    assert not hits, "private names used across modules (make them public in one module):\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from sgl_kvevict.cache import compressor\ncompressor._agree(True)\n", 1),
        ("from sgl_kvevict.cache.compressor import _account\n", 1),
        ("from sgl_kvevict.cache import compressor\ncompressor.agree(True)\n", 0),
    ],
)
def test_private_check_catches_a_planted_use(source: str, expected: int):
    assert len(private_uses("sgl_kvevict.cache.engine", ast.parse(source))) == expected


def policy_names() -> set[str]:
    """Every policy's `name = "..."` in `policies/` (class bodies), read with `ast`. "none" is left out:
    it is also an ordinary word of configuration values."""
    names = set()
    for f in sorted((ROOT / "policies").glob("*.py")):
        for cls in (n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ClassDef)):
            for st in cls.body:
                if (
                    isinstance(st, ast.Assign)
                    and [getattr(t, "id", None) for t in st.targets] == ["name"]
                    and isinstance(st.value, ast.Constant)
                ):
                    names.add(st.value.value)
    return names - {"none", ""}


def policy_name_uses(tree: ast.Module, names: set[str]) -> list[tuple[int, str]]:
    """(line, text) of every string literal (docstrings aside) or identifier that contains a policy's
    name: code that picks behaviour by policy name rather than by a declared property of the policy."""
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    hits = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            text = n.value
        elif isinstance(n, ast.ImportFrom):
            text = n.module or ""
        elif isinstance(n, ast.Name | ast.alias | ast.Attribute | ast.FunctionDef | ast.ClassDef):
            text = getattr(n, "id", None) or getattr(n, "attr", None) or getattr(n, "name", "")
        else:
            continue
        if any(p in text.lower() for p in names):
            hits.append((getattr(n, "lineno", 0), text))
    return hits


def test_the_cache_knows_no_policy_by_name():
    """The runner asks a policy what it declares (`batchable`, `merges`, `needs`, `batch_counts`, ...):
    no policy name in `sgl_kvevict/cache/`, and LagKV's batched selection lives in its own module."""
    names = policy_names()
    assert {"lagkv", "snapkv", "streaming", "knorm", "h2o", "d2o", "graphkv", "criticalkv"} <= names
    bad = [
        f"{MODULES[m].relative_to(ROOT)}:{line}: {text!r}"
        for m in MODULES
        if group(m) == "cache"
        for line, text in policy_name_uses(TREES[m], names)
    ]
    assert not bad, "policy names in the cache (declare a property on the policy instead):\n" + "\n".join(bad)
    assert not (ROOT / "sgl_kvevict" / "cache" / "engine_lagkv.py").exists()


@pytest.mark.parametrize(
    "source, expected",
    [
        ('if pol.name == "lagkv":\n    pass\n', 1),
        ('"""Picks LagKV\'s path."""\nBATCHED = ("h2o", "knorm")\n', 2),
        ("from sgl_kvevict.policies import snapkv\n", 1),
        ("from sgl_kvevict.policies.snapkv import pool_scores\n", 1),
        ('"""SnapKV and H2O, in prose."""\nif pol.batchable:\n    pass\n', 0),
    ],
)
def test_policy_name_check_catches_a_planted_use(source: str, expected: int):
    assert len(policy_name_uses(ast.parse(source), policy_names())) == expected
