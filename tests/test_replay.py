"""A short replay against the real server (2 sessions, 2 turns, tiny outputs) under `none` and `lagkv`,
with SGLang's leak check on after every batch: the result file must have every field, with sane values."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import replay  # noqa: E402
from replay_report import by_kind, cost_markdown, final_kv, summarize  # noqa: E402

from sgl_kvevict.scenarios.base import ScenarioConfig  # noqa: E402

from .helpers import CHECKED_ENV  # noqa: E402

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
    for name in ("agent", "recall", "recall-code", "forks", "long"):
        assert build(name, cfg) == build(name, cfg)
        assert build(name, cfg) != build(name, cfg.model_copy(update={"seed": 8}))


def test_long_scenario_plants_early_and_asks_last() -> None:
    from sgl_kvevict.scenarios import build

    sc = build("long", ScenarioConfig(sessions=2, turns=30, tool_tokens_min=50, tool_tokens_max=600))
    for s in sc.sessions:
        assert len(s.turns) == 30 and s.turns[0].inputs[0].content.startswith("Remember this:")
        assert s.turns[-1].expect and s.turns[-1].expect in s.turns[0].inputs[0].content
        assert all(t.expect is None for t in s.turns[:-1])
        roles = [[m.role for m in t.inputs] for t in s.turns[1:-1]]
        assert ["user"] in roles and ["user", "assistant", "tool"] in roles  # short turns and tool turns
        tools = [len(t.inputs[-1].content) for t in s.turns[1:-1] if t.inputs[-1].role == "tool"]
        assert max(tools) > 3 * min(tools)  # mixed lengths
    with pytest.raises(ValueError, match="turns >= 2"):
        build("long", ScenarioConfig(turns=1))


def test_recall_kind_follows_the_question() -> None:
    """`recall.kind` tells a fact's kind from its value alone; it must agree with what the question asks."""
    from sgl_kvevict.scenarios import build, recall

    cfg = ScenarioConfig(sessions=30, turns=3)
    asks = {"code": "vault code", "name": "my manager", "number": "trip budget"}
    seen = set()
    for s in build("recall", cfg).sessions:
        q = s.turns[-1]
        k = recall.kind(q.expect)
        assert asks[k] in q.inputs[0].content, (q.expect, q.inputs[0].content)
        seen.add(k)
    assert seen == set(asks)


def test_recall_code_scenario_asks_every_session_for_its_vault_code() -> None:
    """`recall-code`: the recall chat's turns, with a four-digit vault code as every session's fact (the
    kind the full cache recalls), and the plain recall scenario unchanged beside it."""
    from sgl_kvevict.scenarios import build, recall

    cfg = ScenarioConfig(sessions=12, turns=14, filler_tokens=150)
    sc = build("recall-code", cfg)
    assert sc.name == "recall-code" and len(sc.sessions) == 12
    values = set()
    for s in sc.sessions:
        assert s.kind == "recall-code" and len(s.turns) == 14
        plant, q = s.turns[0], s.turns[-1]
        assert plant.inputs[0].content == f"Remember this: the vault code is {q.expect}."
        assert recall.kind(q.expect) == "code" and "vault code" in q.inputs[0].content
        assert all("What is the topic of this note?" in t.inputs[0].content for t in s.turns[1:-1])
        values.add(q.expect)
    assert len(values) > 6  # each session its own code
    plain = build("recall", cfg)
    assert plain.sessions[0].turns[0].inputs[0].content == "Remember this: the vault code is 4161."


def test_recall_report_counts_answers_by_kind() -> None:
    q = [
        {"expect": "4161", "correct": True, "answer": "The vault code is 4161."},
        {"expect": "Kenji Hale", "correct": False, "answer": "The topic of this note is gardening."},
        {"expect": "83", "correct": False, "answer": "The trip budget is 100 dollars."},
        {"expect": "952", "correct": False, "answer": None},
    ]
    assert by_kind(q) == ("codes 1/1, names 0/1, budgets 0/2", 1)


def test_cost_report_compares_recall_on_the_turns_with_host_entries() -> None:
    """`replay_report.py --cost`: turn 0 (no host entries in any run) stays out; the run with recall is
    compared with the mean of the runs without it on the same turns."""

    def turns(host: int | None, tps: tuple[float, float], ttft: tuple[float, float]) -> list[dict]:
        return [
            {"turn": i, "decode_tps": v, "ttft": f, "host_tokens": host if i else None}
            for i, (v, f) in enumerate(zip(tps, ttft, strict=True))
        ]

    runs = [
        {"label": "off", "turns": turns(None, (1.0, 10.0), (9.0, 1.0))},
        {"label": "on", "turns": turns(100, (1.0, 5.0), (9.0, 1.5))},
    ]
    out = cost_markdown(runs)
    assert "turns from 1" in out
    assert "| off | off | 1 | 100.0 | 1.00 | 1.00 | 1.00 |" in out
    assert "| on | on | 1 | 200.0 | 2.00 | 1.50 | 1.50 |" in out


def test_a_run_scored_by_f1_summarizes() -> None:
    """A LoCoMo question has a reference and an F1, no expected value to check: it counts in `f1_mean`,
    not in the answer count (the summary once failed on its `correct: None`)."""
    turn = {"session": 0, "turn": 0, "branch": 0, "prompt_tokens": 10, "cached_tokens": 0, "ttft": 0.1}
    turn |= {"decode_tps": 5.0, "completion_tokens": 4, "kv_tokens": 10, "answer": "a cat"}
    f1_turns = [turn | {"expect": "cat", "correct": None, "f1": f} for f in (0.5, 1.0)]
    checked = turn | {"turn": 1, "expect": "4161", "correct": True, "f1": None}
    run = {"label": "none", "policy": "none", "budget": None, "turns": [*f1_turns, checked]}
    run |= {"load": {}, "wall_seconds": 2.0}
    out = summarize(run, None, 1000)
    assert out["f1_mean"] == 0.75 and out["recall_accuracy"] == 1.0 and out["recall_n"] == 1


def test_recall_question_as_a_fork() -> None:
    from sgl_kvevict.scenarios import build

    plain = build("recall", ScenarioConfig(sessions=3, turns=4))
    forked = build("recall", ScenarioConfig(sessions=3, turns=4, question_forks=3))
    for a, b in zip(plain.sessions, forked.sessions, strict=True):
        assert a.turns[:-1] == b.turns[:-1]  # the same history
        q, f = a.turns[-1], b.turns[-1]
        assert f.inputs == [] and len(f.branches) == 3 and f.expect == q.expect
        asks = [br[0].content for br in f.branches]
        assert asks[0] == q.inputs[0].content and len(set(asks)) == 3
        assert all(x.endswith(q.inputs[0].content) for x in asks)
    with pytest.raises(ValueError):
        ScenarioConfig(question_forks=5)


def test_answer_caps_leave_the_plant_room_to_finish() -> None:
    from sgl_kvevict.scenarios import build

    sc = build("recall", ScenarioConfig(sessions=2, turns=4))
    for s in sc.sessions:
        plant, filler, question = s.turns[0], s.turns[1], s.turns[-1]
        assert plant.answer_cap(8) == 16 and plant.answer_cap(24) == 24  # a floor, not a cap
        assert filler.answer_cap(8) == 8 and filler.answer_cap(24) == 24
        assert question.answer_cap(8) == question.answer_cap(64) == question.max_new_tokens
    before = build("recall", ScenarioConfig(sessions=2, turns=4, plant_room=0))  # the earlier scenario
    assert all(s.turns[0].answer_cap(8) == 8 for s in before.sessions)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("snapkv@foo", "unknown scope 'foo'; valid: request, branch"),
        ("snapx@branch", "unknown policy 'snapx'; valid: "),
        ("none@request", "'none' takes no scope"),
        ("snapkv@branch=0", "out of range"),
        ("d2o#no merge", "a variant is letters"),
    ],
)
def test_policy_specs_are_validated(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        replay.parse_spec(text)
    with pytest.raises(SystemExit) as e:
        replay.parse(["--policies", f"none,{text}"])
    assert e.value.code == 2


def test_policy_specs_name_runs() -> None:
    cfg = replay.parse(
        [
            "--policies",
            "none,snapkv,snapkv@request,snapkv@branch=1024",
            "--budgets",
            "256,0.5",
            "--policy-config",
            '{"snapkv": {"window": 16}, "snapkv@branch": {"carry": "none"}}',
        ]
    )
    runs = replay.runs_of(cfg)
    assert [r.label for r in runs] == [
        "none",
        "snapkv@256",
        "snapkv@0.5",
        "snapkv@request@256",
        "snapkv@request@0.5",
        "snapkv@branch@1024",
    ]
    assert replay.policy_config(cfg, runs[1].spec) == {"window": 16}
    assert replay.policy_config(cfg, runs[3].spec) == {"window": 16, "scope": "request"}
    assert replay.policy_config(cfg, runs[5].spec) == {"window": 16, "carry": "none", "scope": "branch"}


def test_policy_variants_are_separate_runs() -> None:
    cfg = replay.parse(
        [
            "--policies",
            "none,d2o,d2o#nomerge,d2o#nomerge@branch",
            "--policy-config",
            '{"d2o": {"beta": 0.5}, "d2o#nomerge": {"merge": false}}',
        ]
    )
    runs = replay.runs_of(cfg)
    assert [r.label for r in runs] == ["none", "d2o@0.5", "d2o#nomerge@0.5", "d2o#nomerge@branch@0.5"]
    assert replay.policy_config(cfg, runs[1].spec) == {"beta": 0.5}
    assert replay.policy_config(cfg, runs[2].spec) == {"beta": 0.5, "merge": False}
    assert replay.policy_config(cfg, runs[3].spec) == {"beta": 0.5, "merge": False, "scope": "branch"}


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
@pytest.mark.long
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


@pytest.mark.server
@pytest.mark.long
def test_long_session_branch_scope_caps_session_kv(tmp_path: Path) -> None:
    """One 8-turn session with short turns under snapkv at a 48-token budget in both scopes: every turn
    reports the session's KV and its branch KV; branch scope holds less at the last turn than request
    scope (which keeps each turn's sinks + recent window), and `none` holds the most."""
    budget = 48
    cfg = replay.BenchConfig(
        scenarios=["long"],
        scenario=ScenarioConfig(
            sessions=1, turns=8, system_tokens=60, tool_tokens_min=40, tool_tokens_max=160
        ),
        concurrency=1,
        max_new_tokens=4,
        policies=["snapkv@request", "snapkv@branch"],
        budgets=[budget],
        max_total_tokens=4000,
        server_mode="shared",
        server_env={k: v for k, v in CHECKED_ENV.items() if k != "KVEVICT_DEBUG"},
        score="none",
        poll_interval=0.5,
        out=tmp_path,
    )
    replay.main(cfg)
    res = json.loads((tmp_path / "replay.json").read_text())
    assert [r["label"] for r in res["runs"]] == ["none", "snapkv@request@48", "snapkv@branch@48"]
    assert [r["scope"] for r in res["runs"]] == [None, "request", "branch"]
    assert "KV per session by turn" in (tmp_path / "replay.md").read_text()
    for run in res["runs"]:
        assert len(run["turns"]) == 8
        assert all(t["error"] is None and t["branch_kv_tokens"] is not None for t in run["turns"]), run
        assert all(t["cached_tokens"] > 0 for t in run["turns"][1:]), run  # history reused every turn
    none, req, br = res["summary"]
    for s in res["summary"]:
        assert len(s["kv_by_turn"]) == 8 and None not in s["kv_by_turn"], s
        assert len(s["branch_kv_by_turn"]) == 8 and None not in s["branch_kv_by_turn"], s
    assert none["kv_by_turn"][-1] > req["kv_by_turn"][-1] > br["kv_by_turn"][-1], (none, req, br)
    assert req["kv_by_turn"][-1] - req["kv_by_turn"][3] > br["kv_by_turn"][-1] - br["kv_by_turn"][3]
    # branch scope: the branch's own KV is capped by one budget (+ sinks, recent window) at every turn end
    assert max(br["branch_kv_by_turn"][1:]) <= budget + 4 + 32, br["branch_kv_by_turn"]
    shared = res["runs"][2]["turns"][-1]["prefix_kv_tokens"]
    assert shared > 0  # the system block is declared shared: never compressed
