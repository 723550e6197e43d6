"""What an operator runs and watches, on one real server with the host tier and SGLang's metrics on:
the host tier's Prometheus series, the OpenAI-client example (`examples/openai_chat.py`) and the replay of
a ShareGPT file (`examples/traffic.jsonl`), each over HTTP as a user would run them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_kvevict.serve import metrics as M
from sgl_kvevict.serve.serverproc import Server

from .helpers import RECALL_BUDGET, host_state, scrape
from .test_recall_e2e import FACT, fillers, session

pytestmark = pytest.mark.server

BUDGET = RECALL_BUDGET  # the server is `conftest.recall_server`, shared with test_recall_e2e.py
SNAP = {"policy": "snapkv", "budget": BUDGET, "config": {"scope": "branch"}}
QUESTION = "What is the vault code? Answer with the number only."
# they move when histories outgrow the host pool: test_recall_e2e's fork test checks borrowed on /metrics
FULL_POOL_COUNTERS = {"histories_borrowed", "histories_moved", "histories_missed"}


def test_host_tier_series_move_with_demotion_recall_and_failures(recall_server: Server):
    """A planted fact, three filler turns and the question under snapkv at 64 tokens, branch scope:
    evictions are demoted and the later turns recall; then the test-only `test_recall_fault` policy fails
    inside recall. Each host series on `/metrics` moves, and agrees with `/server_info`'s host totals."""
    srv = recall_server
    host0 = host_state(srv)  # /server_info publishes the totals to /metrics first
    before = scrape(srv)
    for _, name, _ in (*M.HOST_COUNTERS, *M.HOST_GAUGES):
        assert name in before, f"{name} not on /metrics: {sorted(before)}"
    assert M.RECALL_SECONDS[0] + "_count" in before, sorted(before)
    turns = [FACT, *fillers(71, 3), QUESTION]
    infos, _ = session(srv, SNAP, turns)
    faulty = {**SNAP, "policy": "test_recall_fault"}
    session(srv, faulty, [FACT, *fillers(72, 2), QUESTION])
    host1 = host_state(srv)  # the host still holds the sessions' branches
    middle = scrape(srv)
    recalled_turns = [r for r in infos if r.get("recalled", 0) > 0]
    assert recalled_turns, infos
    for key, name, _ in M.HOST_COUNTERS:  # each counter moved, by what /server_info's totals moved
        grew = middle[name] - before[name]
        assert grew > 0 or key in FULL_POOL_COUNTERS, (name, before[name], middle[name])
        assert grew == host1[key] - host0[key], (name, grew, host1[key], host0[key])
    # SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64 x (K, V) x 2 or 4 bytes an element
    columns = host1["host_used"]
    assert middle["sglang:kvevict_host_columns"] == columns > 0, (middle, host1)
    assert middle["sglang:kvevict_host_bytes"] in {columns * 30 * 3 * 64 * 2 * e for e in (2, 4)}, middle
    n = middle[M.RECALL_SECONDS[0] + "_count"] - before[M.RECALL_SECONDS[0] + "_count"]
    s = middle[M.RECALL_SECONDS[0] + "_sum"] - before[M.RECALL_SECONDS[0] + "_sum"]
    turns_with_recall = [r for r in infos if "recall_seconds" in r]
    assert n >= len(turns_with_recall) >= len(recalled_turns), (n, turns_with_recall)
    assert s >= sum(r["recall_seconds"] for r in recalled_turns) - 1e-3 > 0, (s, recalled_turns)
    srv.flush()  # the host columns go with the tree: the gauges fall back to 0
    assert host_state(srv)["host_used"] == 0
    after = scrape(srv)
    assert after["sglang:kvevict_host_columns"] == 0 and after["sglang:kvevict_host_bytes"] == 0, after


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TURN = re.compile(r"^turn (\d+): (.*)$", re.M)


def test_openai_example_runs_a_chat_with_its_own_policy(recall_server: Server):
    """`examples/openai_chat.py` through the `openai` client: every turn reports the policy it asked for
    (h2o, not the server's snapkv), at its budget, evicts, and from the second turn reuses the compressed
    history the turn before stored."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "openai_chat.py"), "--url", recall_server.url, "--policy", "h2o"]
        + ["--budget", "64", "--turns", "3", "--lines", "30", "--max-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    turns = [(int(n), dict(kv.split("=", 1) for kv in rest.split())) for n, rest in TURN.findall(out.stdout)]
    assert [n for n, _ in turns] == [1, 2, 3], out.stdout
    for n, t in turns:
        assert t["policy"] == "h2o" and t["budget"] == "64", t
        assert int(t["evicted"]) > 0 and int(t["kv_tokens"]) < int(t["logical_tokens"]), t
        if n > 1:
            assert int(t["reused_evicted"]) > 0 and int(t["cached_tokens"]) > 0, t
    assert out.stdout.count("meta_info.kvevict: {") == 3, out.stdout


def test_replay_of_the_shipped_traffic_file_compares_with_none(recall_server: Server, tmp_path: Path):
    """The own-traffic replay of docs/usage.md, reduced (two conversations, two turns each, against the
    running server): it replays `examples/traffic.jsonl` under `none` and snapkv and reports, per run,
    KV held, speed and agreement with `none`'s answers."""
    out = subprocess.run(
        [sys.executable, "benchmarks/replay.py", "--scenarios", "sharegpt"]
        + ["--scenario-path", str(EXAMPLES / "traffic.jsonl"), "--sessions", "2", "--turns", "2"]
        + ["--policies", "none,snapkv", "--budgets", "64", "--max-new-tokens", "8", "--concurrency", "2"]
        + ["--server-mode", "url", "--url", recall_server.url, "--out", str(tmp_path)],
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "replay.json").read_text())
    runs = {r["label"]: r for r in result["runs"]}
    assert set(runs) == {"none", "snapkv@64"}, set(runs)
    for r in runs.values():
        assert len(r["turns"]) == 4 and not any(t["error"] for t in r["turns"]), r["turns"]
        assert {t["kind"] for t in r["turns"]} == {"sharegpt"}
    snap, base = runs["snapkv@64"]["turns"], runs["none"]["turns"]
    assert all(t["evicted"] > 0 for t in snap), snap
    assert sum(t["kv_tokens"] for t in snap) < sum(t["kv_tokens"] for t in base)
    summary = {x["label"]: x for x in result["summary"]}["snapkv@64"]
    assert summary["kv_per_session_vs_none"] < 1 and summary["greedy_agreement"] is not None, summary
    for col in ("KV/session", "agree w/ none", "out tok/s"):
        assert col in out.stdout, out.stdout  # the printed table names quality and cost beside memory
