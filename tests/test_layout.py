"""The package's layout is its architecture: imports point one way and modules keep their privates.

Pure and fast: reads the source with `ast`, imports nothing. Function-local imports count (they run).
The arrows (see `ALLOWED`): serve -> cache -> (policies, kernels, config); config -> policies;
tools may use anything; nothing below imports what sits above it.
"""

from __future__ import annotations

import ast
import re
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
# runs; `cluster` is a command over several servers; `sizing` is the bytes arithmetic of the plugin's
# buffers, shared by the start check, the scheduler and the docs' table.
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "policies": {"kernels"},
    "scenarios": set(),
    "config": {"policies"},
    "sizing": {"config", "policies"},
    "cache": {"config", "policies", "kernels", "sizing"},
    "serve": {"cache", "config", "policies", "kernels", "launch", "model", "cpu_compat", "sizing"},
    "model": set(),
    "launch": {"model"},
    "gpu_model": {"model"},
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


# The compression core: what plans and commits a compression. It meets the host tier through the one
# eviction hook (`cache/eviction.py`) only.
COMPRESSION_CORE = ("sgl_kvevict.cache.compressor", "sgl_kvevict.cache.engine", "sgl_kvevict.cache.trigger")


def host_tier_uses(name: str) -> list[str]:
    """Imports of `cache.host_tier` and reads of a request's or server's host-tier state (`.recall`,
    `.host`) in the module."""
    hits = [f"imports {m}" for m, _ in GRAPH[name] if m.startswith("sgl_kvevict.cache.host_tier")]
    return hits + [
        f"line {n.lineno}: .{n.attr}"
        for n in ast.walk(TREES[name])
        if isinstance(n, ast.Attribute) and n.attr in ("recall", "host")
    ]


def test_the_compression_core_meets_the_host_tier_through_the_eviction_hook_only():
    for name in COMPRESSION_CORE:
        assert not host_tier_uses(name), (name, host_tier_uses(name))
    assert "sgl_kvevict.cache.eviction" in {m for m, _ in GRAPH["sgl_kvevict.cache.compressor"]}


def test_the_host_tier_check_catches_a_planted_use():
    GRAPH["planted"], TREES["planted"] = [], ast.parse("def f(s):\n    return s.recall.appended\n")
    try:
        assert host_tier_uses("planted") == ["line 2: .recall"]
    finally:
        del GRAPH["planted"], TREES["planted"]


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


# ---- state: no `global`, no module-level mutable state outside registries and constants -------------
# The module-level mutable objects the package may hold, each a registry (keys to entries, mutated in
# place, never rebound) or a cache of derived values. A server's state lives in its cache's context
# (`cache/context.py`), never here.
REGISTRIES: dict[str, str] = {
    "sgl_kvevict.cache.context._BY_POOL": "request-row pool -> the context of the server over it (weakly)",
    "sgl_kvevict.cache.state.LIVE": "every live ReqState, weakly (a soak's leak count)",
    "sgl_kvevict.cpu_compat.bf16_linear.WIDE": "fp64 copies of the process's bf16 weights, keyed by weight",
    "sgl_kvevict.policies.registry.REGISTRY": "policy name -> policy class",
    "sgl_kvevict.policies.criticalkv._SIG_W": "fixed random signature weights per (row words, device)",
    "sgl_kvevict.tools.oracle._ACTIVE": "the mask sources HF's attention (registered by name) reads: a stack",
}
# Another module's attribute set from outside it: only test machinery, each named here.
PATCHES: dict[tuple[str, str], str] = {
    (
        "sgl_kvevict.tools.testing",
        "sgl_kvevict.cache.host_tier.recall.exchange",
    ): "the recall fault policy's failure",
    (
        "sgl_kvevict.tools.testing",
        "sgl_kvevict.cache.host_tier.exact_prefill.attend_row",
    ): "the same, in a prefill over both tiers",
}
# Module-level instances of the module's own class that hold nothing that changes (markers, stand-ins).
CONSTANT_INSTANCES = {"sgl_kvevict.cache.tree.MARK", "sgl_kvevict.serve.hooks.DRAINED"}
MUTABLE_CALLS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "deque", "Counter"}
MUTABLE_CALLS |= {"WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault"}
MUTATORS |= {"add", "discard", "sort", "reverse", "__setitem__", "__delitem__"}


def top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements a module runs at import: its body, into `if`/`try` blocks (not functions)."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.If, ast.Try)):
            handlers = [h.body for h in getattr(node, "handlers", [])]
            for part in (node.body, node.orelse, getattr(node, "finalbody", []), *handlers):
                out += top_level(part)
        else:
            out.append(node)
    return out


def mutable_bindings(tree: ast.Module) -> dict[str, tuple[int, bool]]:
    """Module-level names bound to a mutable container or to an instance of the module's own class:
    name -> (line, whether it is such an instance)."""
    own = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    containers = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    found: dict[str, tuple[int, bool]] = {}
    for node in top_level(tree.body):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        v = node.value
        fn = v.func if isinstance(v, ast.Call) else None
        callee = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
        if isinstance(v, containers) or callee in MUTABLE_CALLS | own:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update({t.id: (node.lineno, callee in own) for t in targets if isinstance(t, ast.Name)})
    return found


def mutated_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(bare names, attribute names) whose object the code mutates: `x[k] = v`, `del x[k]`, `x += ...`,
    `x.append(...)` and the other `MUTATORS`."""
    bare: set[str] = set()
    attrs: set[str] = set()

    def note(e: ast.expr) -> None:
        if isinstance(e, ast.Name):
            bare.add(e.id)
        elif isinstance(e, ast.Attribute):
            attrs.add(e.attr)

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            note(node.value)
        elif isinstance(node, ast.AugAssign):
            note(node.target)
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
        ):
            note(node.func.value)
    return bare, attrs


def module_aliases(name: str, tree: ast.Module) -> dict[str, str]:
    """Local name -> package module, for every `from pkg import mod` / `import pkg.mod as m`."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = resolve(name, node)
            aliases.update(
                {a.asname or a.name: f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES}
            )
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.name in MODULES and a.asname})
    return aliases


def state_problems(name: str, tree: ast.Module, attrs_mutated: set[str]) -> list[str]:
    """`global` statements, another module's attributes assigned, and module-level mutable objects
    that are mutated but not declared in `REGISTRIES` / `CONSTANT_INSTANCES`."""
    where = MODULES[name].relative_to(ROOT) if name in MODULES else name
    out = [
        f"{where}:{n.lineno}: global {', '.join(n.names)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Global)
    ]
    aliases = module_aliases(name, tree)
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) else []:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in aliases:
                target = f"{aliases[t.value.id]}.{t.attr}"
                if (name, target) not in PATCHES:
                    out.append(f"{where}:{node.lineno}: sets {target}")
    bare, _ = mutated_names(tree)
    for var, (line, instance) in mutable_bindings(tree).items():
        full = f"{name}.{var}"
        if full in REGISTRIES or full in CONSTANT_INSTANCES:
            continue
        if instance or var in bare or var in attrs_mutated:
            out.append(f"{where}:{line}: module-level mutable state {var} (a registry? add it to REGISTRIES)")
    return out


def test_no_global_and_no_module_state():
    attrs = set().union(*(mutated_names(t)[1] for t in TREES.values()))
    problems = [p for n in MODULES for p in state_problems(n, TREES[n], attrs)]
    assert not problems, "state outside a server's context:\n" + "\n".join(problems)


def test_every_declared_registry_exists():
    declared = set(REGISTRIES) | CONSTANT_INSTANCES
    bound = {f"{n}.{v}" for n in MODULES for v in mutable_bindings(TREES[n])}
    assert declared <= bound, f"stale entries: {sorted(declared - bound)}"


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


@pytest.mark.parametrize(
    "source, expected",
    [
        ("X = None\n\ndef f():\n    global X\n    X = 1\n", 1),  # a global
        ("SEEN = {}\n\ndef f(k):\n    SEEN[k] = 1\n", 1),  # a dict filled at run time
        ("LOG = []\n\ndef f(x):\n    LOG.append(x)\n", 1),
        ("class Box:\n    pass\n\nBOX = Box()\n", 1),  # a module-level instance of its own class
        ("from sgl_kvevict.cache import runtime\n\ndef f(rt):\n    runtime.RT = rt\n", 1),  # another's
        ("NAMES = ['a', 'b']\nTABLE = {'a': 1}\n\ndef f(k):\n    return TABLE[k], NAMES\n", 0),  # constants
    ],
)
def test_state_check_catches_a_planted_global(source: str, expected: int):
    tree = ast.parse(source)
    assert len(state_problems("sgl_kvevict.cache.planted", tree, mutated_names(tree)[1])) == expected


# `grep -rn 'getattr([^)]*kvevict_'` over the package, per line as grep reads: a plugin field read by name off
# an object that lacks it unless the plugin stuck it there (a compressed tree node's fields were once).
STUCK_ON = re.compile(r"getattr\([^)\n]*kvevict_")


def stuck_on_reads(source: str) -> list[int]:
    """Lines of `source` that read a `kvevict_` attribute through `getattr`: the grep's, and the calls
    `ast` finds whose attribute name is a literal holding `kvevict_` (`getattr(f(), "kvevict_x")`, which
    the grep's `[^)]*` stops short of)."""
    lines = {i for i, line in enumerate(source.splitlines(), 1) if STUCK_ON.search(line)}
    for n in ast.walk(ast.parse(source)):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "getattr"
            and len(n.args) > 1
            and isinstance(n.args[1], ast.Constant)
            and "kvevict_" in str(n.args[1].value)
        ):
            lines.add(n.lineno)
    return sorted(lines)


def test_no_plugin_attribute_is_read_by_name():
    """Plugin data lives in typed fields (`CompressedNode`, `KvEvictContext`, ...), not in attributes set
    on another's object and read back with `getattr(..., "kvevict_...", default)`."""
    hits = [
        f"{f.relative_to(ROOT)}:{line}"
        for f in sorted(MODULES.values())
        for line in stuck_on_reads(f.read_text())
    ]
    assert not hits, "attributes read by name (give them a typed home):\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "source, expected",
    [
        ('host.release(pool, getattr(node, "kvevict_host", None))\n', 1),
        ("if getattr(n, '_kvevict_rows', None) is None:\n    pass\n", 1),
        ('x = getattr(object(), "kvevict_x", None)\n', 1),
        ('x = getattr(\n    node,\n    "kvevict_fp",\n)\n', 1),
        ("rows = ctx.forward_rows\nhost.release(pool, node.host_entries)\n", 0),
        ('print("kvevict_compressions_total", getattr(m, "count"))\n', 0),
    ],
)
def test_attribute_check_catches_a_planted_getattr(source: str, expected: int):
    assert len(stuck_on_reads(source)) == expected
