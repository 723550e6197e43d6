"""A short replay against the real server (2 sessions, 2 turns, tiny outputs) under `none` and `lagkv`,
with SGLang's leak check on after every batch: the result file must have every field, with sane values."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import replay  # noqa: E402
from replay_report import final_kv  # noqa: E402

from sgl_kvevict.scenarios.base import ScenarioConfig  # noqa: E402

TURN_FIELDS = {
    "session",
    "turn",
    "branch",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "kv_tokens",
    "ttft",
    "decode_tps",
    "e2e",
    "answer",
    "error",
}
SUMMARY_FIELDS = {
    "kv_per_session",
    "capacity_sessions",
    "peak_running_reqs",
    "peak_used_tokens",
    "radix_hit_rate",
    "prefill_recomputed",
    "e2e_seconds",
    "ttft_p50",
    "ttft_p99",
    "output_tps",
    "recall_accuracy",
}


def test_scenarios_are_deterministic() -> None:
    from sgl_kvevict.scenarios import build

    cfg = ScenarioConfig(sessions=2, turns=3, seed=7)
    for name in ("agent", "recall", "forks"):
        assert build(name, cfg) == build(name, cfg)
        assert build(name, cfg) != build(name, cfg.model_copy(update={"seed": 8}))


def test_sharegpt_loader(tmp_path: Path) -> None:
    from sgl_kvevict.scenarios.sharegpt import load

    data = [
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
                {"from": "human", "value": "bye"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "call"},
                {"role": "tool", "content": "out"},
                {"role": "assistant", "content": "b"},
            ]
        },
    ]
    p = tmp_path / "c.json"
    p.write_text(json.dumps(data))
    sc = load(p, ScenarioConfig(sessions=5, turns=8))
    assert [len(s.turns) for s in sc.sessions] == [2, 1]
    assert sc.sessions[0].system == "be brief"
    assert [m.role for m in sc.sessions[1].turns[0].inputs] == ["user", "assistant", "tool"]


@pytest.mark.server
def test_short_replay(tmp_path: Path) -> None:
    cfg = replay.BenchConfig(
        scenarios=["agent"],
        scenario=ScenarioConfig(
            sessions=2, turns=2, system_tokens=120, tool_tokens_min=150, tool_tokens_max=250
        ),
        concurrency=2,
        max_new_tokens=4,
        policies=["none", "lagkv"],
        budgets=[0.5],
        max_total_tokens=3000,
        server_mode="shared",
        server_env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"},
        poll_interval=0.5,
        out=tmp_path,
    )
    replay.main(cfg)
    res = json.loads((tmp_path / "replay.json").read_text())
    assert (tmp_path / "replay.md").exists()
    assert all(
        (tmp_path / f).stat().st_size > 0
        for f in ("kv_per_turn.png", "quality_vs_memory.png", "throughput.png")
    )
    assert [r["label"] for r in res["runs"]] == ["none", "lagkv@0.5"]
    for run in res["runs"]:
        assert len(run["turns"]) == 4
        for t in run["turns"]:
            assert TURN_FIELDS <= set(t), TURN_FIELDS - set(t)
            assert t["error"] is None
            assert t["prompt_tokens"] > 0 and 0 < t["completion_tokens"] <= 4
            assert t["e2e"] > 0
            assert (
                t["kv_tokens"] is not None
                and 0 < t["kv_tokens"] <= t["prompt_tokens"] + t["completion_tokens"]
            )
            if t["turn"] == 1:
                assert t["cached_tokens"] > 0, t
        assert run["load"]["samples"] > 0
    none_kv, lag_kv = (final_kv(r["turns"]) for r in res["runs"])
    assert all(lag_kv[s] < none_kv[s] for s in none_kv), (lag_kv, none_kv)
    for s in res["summary"]:
        assert SUMMARY_FIELDS <= set(s)
        assert s["errors"] == 0 and 0 < s["radix_hit_rate"] < 1 and s["prefill_recomputed"] > 0
    lag = res["summary"][1]
    assert (
        lag["kv_per_session_vs_none"] < 1
        and lag["greedy_agreement"] is not None
        and lag["loglik_mean"] is not None
    )
