"""Unit tests of the user-facing configuration (no server)."""

from __future__ import annotations

import pytest

from sgl_kvevict import policies
from sgl_kvevict.config import KvConfig, parse_budget, request_override


@pytest.mark.parametrize(
    ("text", "want"), [("256", 256), ("0.5", 0.5), ("1", 1), ("1.0", 1.0), ("300.0", 300), (64, 64)]
)
def test_parse_budget_accepts(text, want):
    got = parse_budget(text)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("text", ["0", "-3", "0.0", "1.5", "abc", "", "nan"])
def test_parse_budget_rejects(text):
    with pytest.raises(ValueError):
        parse_budget(text)


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
