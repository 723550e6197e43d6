"""Fuzz of every user-facing schema (no server): the per-request override, `--kv-policy-config` with
every registered policy, and the operator's flags.

Why: every value a client or operator can send must either give a bounded, valid config or a ValueError
whose message names the field (HTTP 400 / exit 2); never another exception, never an unbounded number.
Plain seeded random generation (no extra dependency); each case list is reproducible from its seed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from typing import Any

import pytest
from pydantic import BaseModel

from sgl_kvevict import policies
from sgl_kvevict.config import (
    FLAG,
    MAX_BUDGET_TOKENS,
    KvConfig,
    OverridePolicy,
    RecallTuning,
    ServerSettings,
    request_override,
)
from sgl_kvevict.serve import plugin

MB = "x" * (1 << 20)
MAX_MSG = 2000  # an error message never echoes a megabyte of input
MAX_INT = MAX_BUDGET_TOKENS  # the largest number any accepted field may hold


def deep(n: int, leaf: Any = 1) -> Any:
    out = leaf
    for i in range(n):
        out = {"a": out} if i % 2 else [out]
    return out


NASTY: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    -(10**9),
    10**9,
    10**30,
    -(10**30),
    0.5,
    -0.5,
    1e-300,
    1e300,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "5",
    "50%",
    "nan",
    MB,
    [],
    [1, 2],
    {},
    {"a": 1},
    {"tokens": 10**9},
    {"ratio": float("nan")},
    deep(500),
]


def nasty(rng: random.Random) -> Any:
    if rng.random() < 0.7:
        return rng.choice(NASTY)
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randint(-(1 << 40), 1 << 40)
    if kind == 1:
        return rng.uniform(-1e6, 1e6)
    if kind == 2:
        return "".join(rng.choice('ab%{}:"1.0 ') for _ in range(rng.randrange(12)))
    return deep(rng.randrange(1, 50), rng.choice(NASTY[:20]))


def near_bounds(model: type[BaseModel], name: str, rng: random.Random) -> Any:
    """A value around the field's own bounds (or its default), to reach the accept side too."""
    field = model.model_fields[name]
    lo = hi = None
    for m in field.metadata:
        lo = getattr(m, "ge", None) if getattr(m, "ge", None) is not None else lo
        lo = getattr(m, "gt", None) if getattr(m, "gt", None) is not None else lo
        hi = getattr(m, "le", None) if getattr(m, "le", None) is not None else hi
        hi = getattr(m, "lt", None) if getattr(m, "lt", None) is not None else hi
    default = field.get_default(call_default_factory=True)
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        return default
    pool = [default] + [b for b in (lo, hi) if b is not None]
    v = rng.choice(pool)
    step = 1 if isinstance(default, int) else rng.choice([1e-9, 0.01, 0.5])
    v = v + rng.choice([-step, 0, step])
    return int(v) if isinstance(default, int) else float(v)


def policy_config(name: str, rng: random.Random) -> tuple[dict[str, Any], str | None]:
    """A config for policy `name` with at most a few nasty fields; returns it and one mutated key."""
    model = policies.REGISTRY[name].Config
    fields = list(model.model_fields)
    cfg: dict[str, Any] = {}
    for f in rng.sample(fields, rng.randrange(len(fields) + 1)) if fields else []:
        cfg[f] = near_bounds(model, f, rng)
    mutated = None
    roll = rng.random()
    if roll < 0.6 and fields:
        mutated = rng.choice(fields)
        cfg[mutated] = nasty(rng)
    elif roll < 0.7:
        mutated = rng.choice(["colour", MB, "sinks "])
        cfg[mutated] = nasty(rng)
    elif roll < 0.8 and "base_config" in fields:
        mutated = "base_config"
        cfg["base_config"] = {rng.choice(["window", "kernel_size", "carry", "zz"]): nasty(rng)}
    return cfg, mutated


def check_bounded(model: BaseModel) -> None:
    """Every number in an accepted config is finite and within [-MAX_INT, MAX_INT]."""
    for name, v in model:
        if isinstance(v, BaseModel):
            check_bounded(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            assert math.isfinite(v) and abs(v) <= MAX_INT, (type(model).__name__, name, v)


def names_field(msg: str, key: str | None, *alts: str) -> bool:
    if key is None:
        return True
    return any(k[:20] in msg for k in (key, *alts))


def check_policy_built(pol: policies.Policy) -> None:
    check_bounded(pol.config)
    for attr in ("base",):  # refiners hold a built base policy
        inner = getattr(pol, attr, None)
        if isinstance(inner, policies.Policy):
            check_bounded(inner.config)


def test_every_numeric_policy_field_has_an_upper_bound():
    for name, cls in policies.REGISTRY.items():
        for fname, field in cls.Config.model_fields.items():
            if field.annotation in (int, float):
                has_hi = any(
                    getattr(m, "le", None) is not None or getattr(m, "lt", None) is not None
                    for m in field.metadata
                )
                assert has_hi, f"{name}.{fname} has no upper bound"
    for fname in ("min_budget_tokens", "min_budget_ratio"):
        meta = OverridePolicy.model_fields[fname].metadata
        assert any(getattr(m, "le", None) is not None for m in meta), fname


@pytest.mark.parametrize("policy", sorted(policies.REGISTRY))
def test_fuzz_policy_config(policy):
    rng = random.Random(f"policy-{policy}")
    accepted = 0
    for _ in range(300):
        cfg, key = policy_config(policy, rng)
        try:
            pol = KvConfig(policy=policy, config=cfg).build()
        except ValueError as e:
            msg = str(e)
            assert len(msg) < MAX_MSG, msg[:200]
            inner = list(cfg.get("base_config", {})) if isinstance(cfg.get("base_config"), dict) else []
            assert names_field(msg, key, *inner, *map(str, cfg)), (key, msg)
            continue
        accepted += 1
        check_policy_built(pol)
    assert accepted > 0  # the generator reaches the accept side too


def test_fuzz_request_override():
    rng = random.Random("override")
    base = KvConfig(policy="snapkv", budget=256, config={"recent": 64, "window": 32})
    rules = [
        ServerSettings(),
        ServerSettings(overrides=OverridePolicy(min_budget_tokens=64, min_budget_ratio=0.25)),
        ServerSettings(overrides=OverridePolicy(policies=["lagkv", "h2o"])),
    ]
    names = sorted(policies.REGISTRY)
    accepted = 0
    for i in range(1500):
        raw: dict[str, Any] = {}
        key = None
        if rng.random() < 0.7:
            raw["policy"] = rng.choice(names)
        if rng.random() < 0.6:
            raw["budget"] = rng.choice([256, 0.5, "50%", {"tokens": 64}, {"ratio": 0.3}, "100%", 2])
        if "policy" in raw and rng.random() < 0.6:
            raw["config"], key = policy_config(raw["policy"], rng)
        roll = rng.random()
        if roll < 0.15:
            key = "budget"
            raw["budget"] = nasty(rng)
        elif roll < 0.25:
            key = "policy"
            raw["policy"] = nasty(rng)
        elif roll < 0.3:
            key = "config"
            raw["config"] = rng.choice([[], "x", 5, None, deep(300)])
        elif roll < 0.35:
            key = rng.choice(["colour", MB])
            raw[key] = nasty(rng)
        custom: Any = {"kvevict": raw}
        if i % 50 == 0:
            custom, key = rng.choice([({"kvevict": nasty(rng)}, "kvevict"), ([1], "custom_params")])
        try:
            cfg = request_override(custom, base, rules[i % len(rules)])
        except ValueError as e:
            msg = str(e)
            assert len(msg) < MAX_MSG, msg[:200]
            conf = raw.get("config") if isinstance(raw, dict) else None
            conf = conf if isinstance(conf, dict) else {}
            inner = conf.get("base_config") if isinstance(conf.get("base_config"), dict) else {}
            named = [*map(str, raw), *map(str, conf), *map(str, inner), "kvevict", "--kv-override"]
            assert names_field(msg, key, *named), (key, msg[:300])  # the field at fault, or the flag
            continue
        if cfg is None:
            continue
        accepted += 1
        assert isinstance(cfg.budget, (int, float)) and not isinstance(cfg.budget, bool)
        assert math.isfinite(cfg.budget) and 0 < cfg.budget <= MAX_BUDGET_TOKENS
        assert isinstance(cfg.budget, int) or cfg.budget <= 1.0
        assert cfg.budget != 1 or isinstance(cfg.budget, float) or raw.get("budget") == {"tokens": 1}
        check_policy_built(cfg.build())
    assert accepted > 100


def _flag(fn, text: str) -> Any:
    """An argparse `type=` function: a value or ArgumentTypeError (argparse -> exit 2), nothing else."""
    try:
        return fn(text)
    except argparse.ArgumentTypeError as e:
        assert 0 < len(str(e)) < MAX_MSG
        return None


FLAG_TEXT = [
    "1",
    "0",
    "2",
    "-5",
    "1.0",
    "0.5",
    "50%",
    "100%",
    "0%",
    "150%",
    "nan",
    "inf",
    "1e30",
    str(10**9),
    str(10**30),
    "",
    " ",
    ",",
    "256,25%",
    "1,2,3",
    '{"tokens": 1}',
    '{"tokens": 1e9}',
    '{"ratio": NaN}',
    "{",
    "[1]",
    "true",
    "null",
    MB,
    "[" * 5000 + "]" * 5000,
    '{"a":' * 500 + "1" + "}" * 500,
    "lagkv,bogus",
    "lagkv",
]


def _type(name: str):
    return plugin._argparse_type(FLAG[name])


def test_fuzz_operator_flags(capsys):
    rng = random.Random("flags")
    texts = FLAG_TEXT + [
        "".join(rng.choice('0123456789.,%{}"tokensratio -') for _ in range(rng.randrange(16)))
        for _ in range(300)
    ]
    for text in texts:
        b = _flag(_type("--kv-budget"), text)
        assert b is None or (not isinstance(b, bool) and 0 < b <= MAX_BUDGET_TOKENS and math.isfinite(b))
        for obj in ({"min_budget": text}, {"policies": text}):
            o = _flag(_type("--kv-overrides"), json.dumps(obj))
            assert o is None or isinstance(o, OverridePolicy)
        o = _flag(_type("--kv-overrides"), text)
        assert o is None or isinstance(o, OverridePolicy)
        r = _flag(_type("--kv-recall-config"), text)
        assert r is None or isinstance(r, RecallTuning)
        c = _flag(_type("--kv-compress-step-tokens"), text)
        assert c is None or (isinstance(c, int) and 1 <= c <= MAX_BUDGET_TOKENS)
        j = _flag(_type("--kv-policy-config"), text)
        assert j is None or isinstance(j, dict)


def test_fuzz_policy_config_flag(monkeypatch, capsys):
    """`--kv-policy-config` through the start hook: accepted, or exit 2 naming the flag."""
    from sgl_kvevict.config import ENV_VAR, SETTINGS_ENV_VAR

    monkeypatch.setenv(ENV_VAR, "")
    monkeypatch.setenv(SETTINGS_ENV_VAR, "")
    rng = random.Random("policy-config-flag")
    names = sorted(policies.REGISTRY)
    for _ in range(200):
        name = rng.choice(names)
        cfg, _key = policy_config(name, rng)
        ns = argparse.Namespace(
            kv_policy=name,
            kv_budget=rng.choice([None, 256, 0.5, 1]),
            kv_policy_config=cfg,
            kv_overrides=None,
        )
        capsys.readouterr()
        try:
            plugin.from_cli_args(None, ns)
        except SystemExit as e:
            assert e.code == 2
            last = capsys.readouterr().err.strip().splitlines()[-1]
            assert "--kv-policy-config" in last and len(last) < MAX_MSG, last[:300]
            continue
        got = KvConfig.model_validate_json(__import__("os").environ[ENV_VAR])
        check_policy_built(got.build())
