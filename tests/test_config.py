"""Unit tests of the user-facing configuration (no server)."""

from __future__ import annotations

import pytest

from sgl_kvevict import policies
from sgl_kvevict.config import (
    SETTINGS_ENV_VAR,
    KvConfig,
    OverridePolicy,
    ServerSettings,
    parse_budget,
    parse_min_budget,
    request_override,
    server_settings,
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("256", 256),
        ("0.5", 0.5),
        ("1.0", 1.0),
        (1.0, 1.0),
        ("300.0", 300),
        (64, 64),
        (2, 2),
        ("50%", 0.5),
        (" 100% ", 1.0),
        ("12.5%", 0.125),
        ("12.3%", 0.123),
        ({"tokens": 1}, 1),
        ({"tokens": 256}, 256),
        ({"ratio": 1}, 1.0),
        ({"ratio": 0.5}, 0.5),
        ('{"tokens": 1}', 1),
        (1 << 24, 1 << 24),
    ],
)
def test_parse_budget_accepts(text, want):
    got = parse_budget(text)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(
    "text",
    [
        "0",
        "-3",
        "0.0",
        "1.5",
        "abc",
        "",
        "nan",
        "inf",
        float("nan"),
        True,
        "0%",
        "101%",
        "nan%",
        "%",
        {"tokens": 0},
        {"tokens": 1.0},
        {"tokens": True},
        {"ratio": 1.5},
        {"ratio": 0},
        {"tokens": 1, "ratio": 0.5},
        {},
        [256],
        None,
        (1 << 24) + 1,
        10**30,
        "x" * 100,
    ],
)
def test_parse_budget_rejects(text):
    with pytest.raises(ValueError):
        parse_budget(text)


@pytest.mark.parametrize("one", [1, "1", " 1 "])
def test_bare_one_is_refused_saying_what_to_write(one):
    with pytest.raises(ValueError) as e:
        parse_budget(one)
    assert '"100%"' in str(e.value) and '{"tokens": 1}' in str(e.value)
    with pytest.raises(ValueError, match="100%"):
        request_override({"kvevict": {"budget": one}}, KvConfig(policy="d2o", budget=256), ServerSettings())


def test_equal_budgets_written_differently_are_one_budget():
    from sgl_kvevict.cache.state import fingerprint

    prints = set()
    for spelling in ("50%", 0.5, "0.5", {"ratio": 0.5}, '{"ratio": 0.5}'):
        cfg = KvConfig(policy="snapkv", budget=spelling)
        assert cfg.budget == 0.5 and type(cfg.budget) is float
        prints.add(fingerprint(cfg, cfg.build()))
    assert len(prints) == 1
    tok = {
        fingerprint(c, c.build())
        for c in (KvConfig(policy="snapkv", budget=b) for b in (256, "256", {"tokens": 256}))
    }
    assert len(tok) == 1 and not tok & prints
    everything = KvConfig(policy="snapkv", budget="100%")
    one = KvConfig(policy="snapkv", budget={"tokens": 1})
    assert fingerprint(everything, everything.build()) != fingerprint(one, one.build())


def test_fingerprint_names_the_whole_producer():
    """Two configs that would compress a history differently never share it: the fingerprint changes with
    the policy, the budget, any policy config field and recall; only `shared_prefix` (where the history
    is, not how it is compressed) and `none` (no compressed history at all) leave it out."""
    from sgl_kvevict.cache.state import fingerprint

    def fp(recall: int = 0, **kw) -> str | None:
        cfg = KvConfig(**{"policy": "snapkv", "budget": 256, **kw})
        return fingerprint(cfg, cfg.build(), recall)

    base = fp()
    others = [
        fp(policy="h2o"),
        fp(budget=128),
        fp(config={"window": 16}),
        fp(config={"sinks": 8}),
        fp(config={"scope": "branch"}),
        fp(recall=64),
    ]
    assert base is not None and base not in others and len(set(others)) == len(others), (base, others)
    assert fp(config={"window": 16}) == fp(config={"window": 16})
    assert fp(config={"shared_prefix": 40}) == base
    assert fp(policy="none") is None


@pytest.mark.parametrize("field", ["sinks", "recent", "interval", "window"])
def test_a_requests_token_counts_are_bounded(field: str):
    """A request's policy config cannot name a window of a billion tokens (the scheduler would allocate
    it): every token count of the base config is refused above `MAX_WINDOW`, and accepted at it."""
    from sgl_kvevict.policies.base import MAX_WINDOW

    base = KvConfig(policy="d2o", budget=256)
    big = {"window": 1, "recent": MAX_WINDOW + 1} if field == "recent" else {field: MAX_WINDOW + 1}
    for value in (MAX_WINDOW + 1, 10**9):
        cfg = {k: (value if k == field else v) for k, v in big.items()}
        with pytest.raises(ValueError, match=field):
            request_override({"kvevict": {"policy": "knorm", "config": cfg}}, base, ServerSettings())
    ok = {"window": 1, "recent": MAX_WINDOW} if field == "recent" else {field: MAX_WINDOW}
    if field == "window":
        ok["recent"] = MAX_WINDOW
    got = request_override({"kvevict": {"policy": "knorm", "config": ok}}, base, ServerSettings())
    assert getattr(got.build().config, field) == MAX_WINDOW


def test_one_token_survives_the_trip_to_the_scheduler():
    one = KvConfig(policy="snapkv", budget={"tokens": 1})
    back = KvConfig.model_validate_json(one.to_env())
    assert back.budget == 1 and type(back.budget) is int
    assert request_override({"kvevict": {"policy": "h2o"}}, one, ServerSettings()).budget == 1
    whole = KvConfig.model_validate_json(KvConfig(policy="snapkv", budget="100%").to_env())
    assert whole.budget == 1.0 and type(whole.budget) is float


def test_ratio_budget_resolves_against_suffix():
    cfg = KvConfig(policy="snapkv", budget=0.25)
    assert cfg.resolve_budget(1000) == 250
    assert cfg.resolve_budget(1000, always_kept=36) == 214  # a ratio counts the windows inside it
    assert cfg.resolve_budget(100, always_kept=36) == 0
    assert KvConfig(policy="snapkv", budget=128).resolve_budget(1000, always_kept=36) == 128


def test_unknown_policy_names_valid_choices():
    with pytest.raises(ValueError) as e:
        KvConfig(policy="bogus")
    for name in ("lagkv", "d2o", "snapkv", "none"):
        assert name in str(e.value)


def test_request_override_merges_and_validates():
    base = KvConfig(policy="d2o", budget=256)
    assert request_override(None, base) is None
    assert request_override({"other": 1}, base) is None
    got = request_override({"kvevict": {"budget": 64}}, base)
    assert got is not None and got.policy == "d2o" and got.budget == 64
    got = request_override({"kvevict": {"policy": "lagkv", "config": {"lag": 32}}}, base)
    assert got.policy == "lagkv" and got.config == {"lag": 32} and got.budget == 256
    for bad, word in [
        ({"policy": "nope"}, "valid choices"),
        ({"budget": 2.5}, "budget"),
        ({"colour": 1}, "unknown field"),
        ({"policy": "lagkv", "config": {"lag": -4}}, "lag"),
        ("lagkv", "object"),
    ]:
        with pytest.raises(ValueError) as e:
            request_override({"kvevict": bad}, base)
        assert word in str(e.value)


def test_registry_lists_required_policies():
    want = {"none", "streaming", "knorm", "h2o", "snapkv", "lagkv", "d2o", "graphkv", "criticalkv"}
    assert want <= set(policies.available())


# -- the operator's override rules (--kv-overrides) ---------------------------------------------------


def _settings(**kw) -> ServerSettings:
    quant = kw.pop("quantization", None)
    return ServerSettings(overrides=OverridePolicy(**kw), quantization=quant)


def _deny(custom: dict, base: KvConfig, settings: ServerSettings, *words: str) -> None:
    with pytest.raises(ValueError) as e:
        request_override({"kvevict": custom}, base, settings)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_disabled_overrides_deny_everything():
    base = KvConfig(policy="d2o", budget=256)
    s = _settings(enabled=False)
    for custom in ({}, {"budget": 512}, {"policy": "d2o"}, {"policy": "none"}):
        _deny(custom, base, s, "--kv-overrides off")
    assert request_override({"other": 1}, base, s) is None  # no kvevict key: nothing to deny


def test_allowed_policies():
    base = KvConfig(policy="d2o", budget=256)
    s = _settings(policies=["lagkv", "snapkv"])
    assert request_override({"kvevict": {"policy": "lagkv"}}, base, s).policy == "lagkv"
    assert request_override({"kvevict": {"policy": "d2o"}}, base, s).policy == "d2o"  # the server's own
    assert request_override({"kvevict": {"budget": 300}}, base, s).policy == "d2o"
    _deny({"policy": "h2o"}, base, s, "'h2o'", "--kv-overrides policies lagkv,snapkv")
    _deny({"policy": "none"}, base, s, "'none'", "--kv-overrides policies")
    with pytest.raises(ValueError, match="valid choices"):
        OverridePolicy(policies=["lagkv", "bogus"])


def test_min_budget_same_kind_only():
    base = KvConfig(policy="d2o", budget=256)
    tok = _settings(min_budget_tokens=128)
    assert request_override({"kvevict": {"budget": 128}}, base, tok).budget == 128
    assert request_override({"kvevict": {"budget": 4096}}, base, tok).budget == 4096
    _deny({"budget": 127}, base, tok, "below", "128", "--kv-overrides min_budget")
    _deny({"budget": 0.9}, base, tok, "ratio", "--kv-overrides min_budget 128")  # not comparable: denied
    _deny({"budget": 1.0}, base, tok, "ratio")
    rat = _settings(min_budget_ratio=0.25)
    assert request_override({"kvevict": {"budget": 0.25}}, base, rat).budget == 0.25
    _deny({"budget": 0.2}, base, rat, "below", "0.25")
    _deny({"budget": 100000}, base, rat, "tokens", "--kv-overrides min_budget 0.25")
    both = _settings(min_budget_tokens=128, min_budget_ratio=0.25)
    assert request_override({"kvevict": {"budget": 0.3}}, base, both).budget == 0.3
    assert request_override({"kvevict": {"budget": 200}}, base, both).budget == 200
    _deny({"budget": 64}, base, both, "below", "128")
    _deny({"budget": 0.1}, base, both, "below", "0.25")
    # the server's own budget is always allowed, and a policy change keeps it
    low = KvConfig(policy="d2o", budget=64)
    assert request_override({"kvevict": {"budget": 64}}, low, tok).budget == 64
    assert request_override({"kvevict": {"policy": "lagkv"}}, low, tok).budget == 64
    # a token budget 1 is not the ratio 1.0 even though 1 == 1.0 in Python
    _deny({"budget": {"tokens": 1}}, KvConfig(policy="d2o", budget=1.0), tok, "below")
    assert request_override({"kvevict": {"budget": "30%"}}, base, rat).budget == 0.3


def test_quantized_o_proj_denies_criticalkv_overrides():
    base = KvConfig(policy="d2o", budget=256)
    s = _settings(quantization="--quantization fp8")
    _deny({"policy": "criticalkv"}, base, s, "o_proj", "--quantization fp8")
    assert request_override({"kvevict": {"policy": "snapkv"}}, base, s).policy == "snapkv"


def test_window_must_fit_in_recent_for_attention_policies():
    with pytest.raises(policies.PolicyConfigError, match="'window' \\(64\\) must be <= 'recent' \\(32\\)"):
        KvConfig(policy="snapkv", config={"window": 64}).build()
    KvConfig(policy="snapkv", config={"window": 16, "recent": 16}).build()
    KvConfig(policy="lagkv", config={"window": 64}).build()  # no attention scores: the window is unused
    base = KvConfig(policy="d2o", budget=256)
    _deny({"config": {"recent": 8}}, base, ServerSettings(), "'window' (32)", "'recent' (8)")


def test_server_settings_travel_through_the_environment(monkeypatch):
    s = _settings(policies=["lagkv"], min_budget_tokens=64)
    monkeypatch.setenv(SETTINGS_ENV_VAR, s.to_env())
    assert server_settings() == s
    base = KvConfig(policy="d2o", budget=256)
    with pytest.raises(ValueError, match="--kv-overrides policies"):
        request_override({"kvevict": {"policy": "h2o"}}, base)  # default settings: this process's
    monkeypatch.delenv(SETTINGS_ENV_VAR)
    assert server_settings() == ServerSettings()


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("256", (256, None)),
        ("0.25", (None, 0.25)),
        ("25%", (None, 0.25)),
        ("256,0.25", (256, 0.25)),
        ("0.5, 64", (64, 0.5)),
        ("256,25%", (256, 0.25)),
        ('{"tokens": 1}', (1, None)),
    ],
)
def test_parse_min_budget(text, want):
    assert parse_min_budget(text) == want


@pytest.mark.parametrize("text", ["", "0", "1", "1.5", "64,128", "0.1,0.2", "1,2,3", "x", "10%,0.2", "1e30"])
def test_parse_min_budget_rejects(text):
    with pytest.raises(ValueError):
        parse_min_budget(text)


# -- the rules that relate two settings: Launch's validators --------------------------------------------


def _launch(policy: str = "snapkv", config: dict | None = None, scope=None, running=None, **settings):
    """The server as the launcher validates it: the flags given, as the plugin hands them over."""
    from sgl_kvevict.config import Launch

    kv = {"policy": policy, "config": config or {}}
    return Launch.model_validate(
        {"kv": kv, "settings": settings, "scope": scope, "max_running_requests": running}
    )


def _refused(*words: str, **kw) -> None:
    """`_launch(**kw)` is refused with one line holding every word (what the start prints, exit 2)."""
    from pydantic import ValidationError

    from sgl_kvevict.config import first_error

    with pytest.raises(ValidationError) as e:
        _launch(**kw)
    line = first_error(e.value)
    for word in words:
        assert word in line, line


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("host_tokens", 16384, "--kv-host-tokens"),
        ("host_gib", 1.0, "--kv-host-gib"),
        ("recall", {}, "--kv-recall-config"),
    ],
)
def test_host_tier_settings_need_recall(field: str, value, flag: str):
    """A host-tier setting given without the tier is refused, even at its default (it would do nothing);
    with the tier on it is taken. The published settings carry every field and still read back."""
    _refused(flag, "--kv-recall-tokens N (N >= 1)", **{field: value})
    _refused(flag, "--kv-recall-tokens", recall_tokens=0, **{field: value})
    got = _launch(recall_tokens=8, **{field: value}).settings
    assert ServerSettings.from_env(got.to_env()) == got
    assert ServerSettings.from_env(ServerSettings().to_env()) == ServerSettings()


def test_one_host_size():
    _refused("--kv-host-gib and --kv-host-tokens", "give one", recall_tokens=8, host_gib=1.0, host_tokens=64)
    assert _launch(recall_tokens=8, host_gib=1.0).settings.host_gib == 1.0


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({"scope": "branch"}, {"scope": "branch"}),
        ({"config": {"scope": "branch"}}, {"scope": "branch"}),
        ({"scope": "branch", "config": {"scope": "branch"}}, {"scope": "branch"}),
        ({"scope": "request"}, {}),  # the policy's default, written as no scope
        ({"recall_tokens": 8}, {"scope": "branch"}),  # a server that recalls: branch by default
        ({"recall_tokens": 8, "scope": "request"}, {}),
        ({"recall_tokens": 8, "config": {"scope": "request"}}, {"scope": "request"}),
        ({}, {}),
    ],
)
def test_scope_is_one_field_with_a_default_for_recall(kw: dict, want: dict):
    assert _launch(**kw).kv.config == want


def test_scope_given_twice_must_agree():
    _refused(
        "argument --kv-scope", "'request'", "'branch'", "once", scope="request", config={"scope": "branch"}
    )


def test_policy_config_is_checked_with_its_scope():
    _refused("argument --kv-policy-config", "'window' (64)", "'recent' (32)", config={"window": 64})
    _refused("argument --kv-policy-config", "scope", policy="lagkv", config={"scope": "tree"})


def test_recall_needs_a_compressing_policy():
    _refused("--kv-recall-tokens", "give --kv-policy", policy="none", recall_tokens=8)
    assert _launch(policy="none").kv.config == {}  # no recall: nothing to default


def test_quantized_o_proj_refuses_the_policy_that_reads_it():
    _refused(
        "--kv-policy criticalkv",
        "o_proj",
        "--quantization fp8",
        policy="criticalkv",
        quantization="--quantization fp8",
    )
    assert _launch(policy="snapkv", quantization="--quantization fp8").settings.quantization
    assert _launch(policy="criticalkv").kv.policy == "criticalkv"


@pytest.mark.parametrize(
    ("kw", "window", "slots"),
    [
        ({"policy": "lagkv", "overrides": {"enabled": False}}, None, 128),  # no request may capture
        ({"policy": "lagkv"}, 32, 128),  # an override may name snapkv (default window 32)
        ({"config": {"window": 48, "recent": 64}}, 48, 128),
        ({"policy": "h2o", "overrides": {"max_window": 64}, "running": 8}, 64, 8),
        ({"policy": "h2o", "running": 100000}, 32, 4096),  # capped: MAX_CAPTURE
        ({"policy": "lagkv", "overrides": {"enabled": False}, "recall_tokens": 8}, 32, 128),  # recall scores
        ({"policy": "none"}, None, 128),
    ],
)
def test_capture_buffer_is_sized_at_start(kw: dict, window, slots):
    got = _launch(**kw).settings
    assert (got.capture_window, got.capture_slots) == (window, slots)


def test_capture_buffer_holds_the_server_policys_window():
    _refused(
        "--kv-overrides max_window 32",
        "window 48",
        config={"window": 48, "recent": 64},
        overrides={"max_window": 32},
    )
    # above the buffer's bound: refused at start, not published for the scheduler to refuse
    _refused("--kv-policy-config window 5000", "4096", config={"window": 5000, "recent": 5000})


# -- a flag's value is checked by its field --------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--kv-recall-tokens", "4097", ["4097 out of range", "[0, 4096]"]),
        ("--kv-recall-tokens", -1, ["out of range", "[0, 4096]"]),
        ("--kv-recall-tokens", True, ["must be an integer in [0, 4096]", "True"]),
        ("--kv-recall-tokens", 2.0, ["must be an integer in [0, 4096]"]),
        ("--kv-recall-tokens", "5.0", ["must be an integer in [0, 4096]"]),
        ("--kv-host-tokens", 0, ["out of range", "[1, 2097152]"]),
        ("--kv-host-gib", float("nan"), ["out of range", "[0.001, 4096.0]"]),
        ("--kv-host-gib", "lots", ["must be a number in [0.001, 4096.0]"]),
        ("--kv-host-gib", False, ["must be a number"]),
        ("--kv-compress-step-tokens", "1e9", ["must be an integer in [1, 16777216]"]),
    ],
)
def test_a_number_flag_is_checked_by_its_field(flag: str, value, words: list[str]):
    """A number flag's type and bounds are its field's, checked by pydantic (strictly: no bool, no 2.0
    for 2); the refusal names the range, as the command line and `sgl.Engine` report it."""
    from sgl_kvevict.config import FLAG

    with pytest.raises(ValueError) as e:
        FLAG[flag].coerce(value)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_a_number_flag_takes_its_fields_values():
    from sgl_kvevict.config import FLAG

    assert FLAG["--kv-recall-tokens"].parse(" 8 ") == 8
    gib = FLAG["--kv-host-gib"].coerce(1)
    assert gib == 1.0 and type(gib) is float
    assert FLAG["--kv-compress-step-tokens"].coerce(1 << 24) == 1 << 24


# -- the flag tables of docs/usage.md are the models' ------------------------------------------------


def _doc_tables(header: str) -> list[dict[str, list[str]]]:
    """Every table of docs/usage.md under `header`: first cell (unquoted) -> the other cells."""
    from pathlib import Path

    lines = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text().splitlines()
    tables, rows = [], None
    for line in lines:
        if line.strip() == header:
            rows = {}
            tables.append(rows)
        elif rows is not None and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows[cells[0].strip("`").split(" ")[0]] = cells[1:]
        elif rows is not None and not line.startswith("|"):
            rows = None
    return tables


def _check_row(name: str, info, rng: str, choices, cells: list[str]) -> None:
    import json
    import re

    doc_range, doc_default = cells[0], cells[1].strip("`")
    if choices is not None:
        assert set(re.findall(r"`([^`]+)`", doc_range)) == set(choices), (name, doc_range)
    elif rng:
        assert doc_range == rng, (name, doc_range, rng)
    if info.default_factory is None and info.default is not None:
        want = info.default if isinstance(info.default, str) else json.dumps(info.default)
        assert doc_default == want, (name, doc_default, want)


def test_usage_flag_table_is_the_models():
    """Every flag of the models is in docs/usage.md's table with its range, choices and default, and the
    table has no other; so do the keys of the two JSON flags."""
    from sgl_kvevict.config import FLAG, FLAGS, OverridePolicy, RecallTuning
    from sgl_kvevict.config import Flag as F

    (flags,) = _doc_tables("| flag | range | default | meaning |")
    assert set(flags) == set(FLAG), set(flags) ^ set(FLAG)
    for f in FLAGS:
        _check_row(f.name, f.info, f.range, f.choices, flags[f.name])
    assert flags["--kv-policy-config"][1] == "`{}`"
    keys = _doc_tables("| key | range | default | meaning |")
    by_model = {OverridePolicy: {"min_budget"}, RecallTuning: set()}
    for model, extra in by_model.items():
        (table,) = [t for t in keys if set(t) & set(model.model_fields)]
        assert set(table) == set(model.model_fields) | extra, set(table) ^ set(model.model_fields)
        for key, info in model.model_fields.items():
            sub = F(key, model, key)
            _check_row(key, info, sub.range, sub.choices, table[key])
