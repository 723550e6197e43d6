"""Every setting a user can write is documented, checked from the models (no list of names here):

- each pydantic field of the request config (`KvConfig`: the `custom_params.kvevict` keys), of
  `--kv-overrides` (`OverridePolicy`) and `--kv-recall-config` (`RecallTuning`), each launcher flag
  (`config.FLAGS`), and each field of every registered policy's config model has its row in the docs,
  with the model's default and range;
- each `sglang:kvevict_*` metric the plugin registers has its row in docs/deployment.md, and the docs
  name no other;
- `--help` (the flags' help, as the launcher prints it) and the docs agree on every default and range.
"""

from __future__ import annotations

import argparse
import json
import re
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sgl_kvevict import config as C
from sgl_kvevict.policies.registry import REGISTRY
from sgl_kvevict.serve import metrics as M
from sgl_kvevict.serve import plugin

DOCS = Path(__file__).resolve().parent.parent / "docs"
POLICY_HEADER = "| policy | field | range | default | meaning |"


def tables(page: str, header: str) -> list[list[list[str]]]:
    """The rows (cells) of every table of `page` whose header line is `header`."""
    out, rows = [], None
    for line in (DOCS / page).read_text().splitlines():
        if line.strip() == header:
            rows = []
            out.append(rows)
        elif rows is not None and line.startswith("|---"):
            continue
        elif rows is not None and line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif rows is not None:
            rows = None
    return out


def doc_range(info: FieldInfo) -> str:
    """A field's range as the docs write it: `[lo, hi]` with `(`/`)` for strict bounds, the choices of a
    Literal or a bool in backticks, '' otherwise."""
    ann = info.annotation
    if ann is bool:
        return "`true`, `false`"
    if typing.get_origin(ann) is typing.Literal:
        return ", ".join(f"`{a}`" for a in typing.get_args(ann))
    return C.interval(info)


def doc_default(info: FieldInfo) -> str:
    val = info.default_factory() if info.default_factory is not None else info.default
    return f"`{val}`" if isinstance(val, str) else f"`{json.dumps(val)}`"


def policy_rows() -> list[list[str]]:
    """The table of every policy config field docs/policies.md must hold: one row per field and
    (range, default, meaning), naming the policies that share them (`all`: every registered one)."""
    groups: dict[tuple[str, str, str, str], list[str]] = {}
    for name in sorted(REGISTRY):
        for field, info in REGISTRY[name].Config.model_fields.items():
            key = (field, doc_range(info), doc_default(info), (info.description or "").replace("|", "\\|"))
            groups.setdefault(key, []).append(name)
    rows = []
    for (field, rng, default, meaning), names in groups.items():
        who = "all" if len(names) == len(REGISTRY) else ", ".join(f"`{n}`" for n in names)
        rows.append([who, f"`{field}`", rng or "-", default, meaning])
    return sorted(rows, key=lambda r: (r[0] != "all", r[0], r[1]))


def test_every_policy_config_field_has_its_row():
    """docs/policies.md's field table is exactly the registered policies' config models."""
    want = policy_rows()
    got = [t for t in tables("policies.md", POLICY_HEADER)]
    text = "\n".join("| " + " | ".join(r) + " |" for r in want)
    assert len(got) == 1, f"docs/policies.md needs one table headed {POLICY_HEADER!r}; it is:\n{text}"
    assert got[0] == want, "docs/policies.md's field table differs from the models; it should be:\n" + text


def _key_table(model: type[BaseModel]) -> dict[str, list[str]]:
    """The docs/usage.md `| key | range | default | meaning |` table holding `model`'s keys."""
    found = [
        {r[0].strip("`"): r[1:] for r in t}
        for t in tables("usage.md", "| key | range | default | meaning |")
        if {r[0].strip("`") for r in t} & set(model.model_fields)
    ]
    assert len(found) == 1, (model.__name__, len(found))
    return found[0]


def test_every_json_flag_key_and_request_key_is_documented():
    """`--kv-overrides` and `--kv-recall-config` keys (whatever fields the models have now), their
    spellings (`min_budget`), and every `custom_params.kvevict` key."""
    for model in (C.OverridePolicy, C.RecallTuning):
        table = _key_table(model)
        spellings = set(getattr(model, "SPELLINGS", {}))
        assert set(table) == set(model.model_fields) | spellings, (model.__name__, set(table))
    usage = (DOCS / "usage.md").read_text()
    per_request = usage[usage.index("### Per request") :]
    for key in C.KvConfig.model_fields:  # the request's keys are KvConfig's fields
        assert re.search(rf'[`"]{key}[`"]', per_request), f"custom_params.kvevict key {key!r} undocumented"


def test_every_metric_is_documented_and_no_other():
    registered = {n for _, n, _ in (*M.COUNTERS, *M.GAUGES, *M.HOST_COUNTERS, *M.HOST_GAUGES)}
    registered.add(M.RECALL_SECONDS[0])
    text = (DOCS / "deployment.md").read_text()
    rows = set(re.findall(r"^\| `(sglang:kvevict_\w+)` \|", text, re.M))
    assert rows == registered, {"undocumented": registered - rows, "not registered": rows - registered}
    named = set(re.findall(r"sglang:kvevict_\w+", "\n".join(p.read_text() for p in DOCS.glob("*.md"))))
    assert named <= registered, named - registered


def help_text() -> str:
    """The plugin's part of the launcher's `--help`, as argparse prints it."""
    parser = argparse.ArgumentParser(prog="launch_server", formatter_class=argparse.HelpFormatter)
    plugin.add_cli_args(None, parser)
    text = re.sub(r"\s+", " ", parser.format_help())
    return text[text.index("sgl-kvevict (KV-cache compression):") :]


def _flag_help(text: str, name: str) -> str:
    """The help of one flag: from its name (followed by its metavar) to the next flag's."""
    heads = [m.start() for m in re.finditer(r"--kv-[\w-]+ (?:[A-Z_]{3,}|\{)", text)]
    start = text.index(name + " " + ("{" if C.FLAG[name].choices else C.FLAG[name].dest.upper()))
    return text[start : min([h for h in heads if h > start] or [len(text)])]


def _key_help(h: str, model: type[BaseModel], key: str) -> str:
    """One key's part of a JSON flag's help: from `key: ` to the next key's."""
    keys = [*model.model_fields, *getattr(model, "SPELLINGS", {})]
    start = h.index(f": {key}: ") if key == keys[0] else h.index(f"; {key}: ")
    nxt = keys.index(key) + 1
    end = h.index(f"; {keys[nxt]}: ") if nxt < len(keys) else len(h)
    return h[start:end]


def test_help_and_docs_agree_on_defaults_and_ranges():
    """Each flag's `--help` states its default and its range or choices, equal to docs/usage.md's flag
    table; each JSON flag's `--help` names every key with the default and range its docs table gives
    (one default per key)."""
    text = help_text()
    (flags,) = tables("usage.md", "| flag | range | default | meaning |")
    doc = {r[0].strip("`").split(" ")[0]: r[1:] for r in flags}
    for f in C.FLAGS:
        h = _flag_help(text, f.name)
        if f.nested is None:
            want = doc[f.name][1].strip("`")
            if f.default is None:  # no value: the help says what happens instead (`default: no cap`)
                assert h.count("default") == 1 and want == "none", (f.name, h, want)
            else:
                m = re.search(r"default (\S+?)[;)]?(?: |$)", h)
                assert m, f"--help of {f.name} states no default: {h}"
                assert m.group(1) == want, (f.name, h, want)
            if f.choices is None and f.range:
                assert f"in {f.range}" in h and doc[f.name][0] == f.range, (f.name, h, doc[f.name][0])
            continue
        table = _key_table(f.nested)
        for key, cells in table.items():
            stated = _key_help(h, f.nested, key)
            assert stated.count("default") == 1, f"{f.name} {key}: one default in --help, not {stated!r}"
            info = f.nested.model_fields.get(key)
            m = re.search(r"\(default (\S+?)[;)]", stated)
            doc_dflt = cells[1].strip("`")
            if m:  # `null` in JSON, `none` in the docs' tables
                said = m.group(1).strip('"')
                null = said == "null" and (doc_dflt == "none" or f"null: {doc_dflt}" in stated)
                assert said == doc_dflt or null, (f.name, key, said, doc_dflt)
            else:  # the description states it (`max_window`): the docs cell must not be a value
                assert info is not None and info.default is None, (f.name, key, stated)
            rng = C.Flag(key, f.nested, key).range if info is not None else ""
            if rng and "|" not in rng:
                assert rng in stated and cells[0] == rng, (f.name, key, stated, cells[0])
            elif rng:
                assert set(rng.split(" | ")) == set(re.findall(r"`([^`]+)`", cells[0])), (key, cells[0])


def test_the_checks_catch_a_missing_row():
    """The checkers themselves: a field that is in no table, and a default the docs state differently,
    are found."""
    rows = policy_rows()
    assert any(r[1] == "`neighbors`" for r in rows)  # a field the docs once missed is in the wanted table
    assert doc_range(C.OverridePolicy.model_fields["min_budget_ratio"]) == "(0.0, 1.0]"
    assert doc_default(C.RecallTuning.model_fields["page"]) == "`8`"
    assert "--kv-policy " in help_text()
