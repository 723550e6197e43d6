"""Reliability on one real server in a small pool: aborts under every policy, a policy fault in the middle
of a staged compaction, memory pressure with retractions, and a short soak (`benchmarks/bench_soak.py`).

One server (`--max-total-tokens 6000`, aggressive admission, compression capped at 1,024 region tokens per
scheduler step, SGLang's busy/idle leak checks and KV page invariants on) serves every test; policies come
per request. After each test the pool must be whole once flushed, and the log
must hold no traceback other than the ones a test provokes on purpose.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sgl_kvevict.serve.serverproc import Server

from .helpers import _server, chat_ids, long_text, scheduler_report, speed, watchdog

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_soak import flush_until_whole, run_soak  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.long]

POLICIES = ["streaming", "knorm", "h2o", "snapkv", "lagkv", "d2o", "graphkv", "criticalkv"]
POOL_TOKENS = 6000


@pytest.fixture(scope="module")
def small_server() -> Iterator[Server]:
    yield from _server(
        [
            "--max-total-tokens",
            str(POOL_TOKENS),
            "--kv-policy",
            "snapkv",
            "--kv-budget",
            "128",
            "--chunked-prefill-size",
            "1024",
            # Admit on a small estimate of each request's future tokens: decode then outgrows the pool and
            # SGLang must retract (memory pressure on purpose).
            "--schedule-conservativeness",
            "0.1",
            # Compression work per scheduler step capped: deferrals, and compressions split over steps
            # (regions over 256 tokens), run under all of the above, aborts and retractions included.
            "--kv-compress-step-tokens",
            "256",
        ]
    )


def kvinfo(out: dict) -> dict:
    return out["meta_info"]["kvevict"][0]


def whole(srv: Server) -> dict:
    state = flush_until_whole(srv.url)
    assert state["available_tokens"] == state["max_total_tokens"] == POOL_TOKENS, state
    return state


def tracebacks(srv: Server) -> list[str]:
    text = srv.log_path.read_text(errors="replace")
    return [b[:400] for b in text.split("Traceback")[1:]]


def stream(srv: Server, ids: list[int], kv: dict, rid: str, n: int = 300, timeout: float = 600):
    body = {
        "rid": rid,
        "input_ids": ids,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"kvevict": kv},
        },
    }
    return requests.post(srv.url + "/generate", json=body, stream=True, timeout=timeout)


def read_chunks(lines, k: int) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith(b"data:") and line != b"data: [DONE]":
            out.append(json.loads(line[5:]))
            if len(out) >= k:
                break
    return out


ENDPOINT_AFTER = 80  # chunks a stream reads before /abort_request stops it


def abort_stream(
    srv: Server, ids: list[int], kv: dict, rid: str, how: str, n: int, after: int, timeout: float
) -> tuple[str, dict | None]:
    """Open a stream of `n` tokens and read 3 chunks; then `disconnect` closes it, `endpoint` reads up to
    `after` chunks and aborts it through SGLang's /abort_request. Returns the outcome (`closed`, or the
    finish reason) and, for `endpoint`, the request's last kvevict stats."""
    with stream(srv, ids, kv, rid, n=n, timeout=timeout) as r:
        assert r.status_code == 200, r.text[:300]
        lines = r.iter_lines()
        got = read_chunks(lines, 3)
        assert len(got) == 3, (rid, got)
        if how == "disconnect":
            return "closed", None
        got += read_chunks(lines, after - 3)
        a = requests.post(srv.url + "/abort_request", json={"rid": rid}, timeout=60)
        assert a.status_code == 200
        last = (read_chunks(lines, 10**6) or got)[-1]["meta_info"]
        assert last["completion_tokens"] < n, (rid, last)  # it really stopped early
        return last["finish_reason"]["type"], [x for x in last["kvevict_stream"] if x][-1]


# ---- aborts under every policy ---------------------------------------------------------------------
def test_aborts_under_every_policy(small_server: Server):
    """Per policy (and `none`): a stream closed by the client after a few chunks, and a running stream
    aborted through SGLang's /abort_request; all at once. The aborted requests end as aborted, the
    server keeps serving, and nothing leaks."""
    before = len(tracebacks(small_server))
    failures0 = whole(small_server)["policy_failures"]
    names = ["none", *POLICIES]
    cases = [(p, h) for p in names for h in ("disconnect", "endpoint")]
    prompt = {
        c: chat_ids([{"role": "user", "content": long_text(500, seed=300 + i)}]) for i, c in enumerate(cases)
    }
    results: dict[tuple[str, str], tuple[str, int]] = {}
    lock = threading.Lock()
    # Timeouts from this server's measured speed (a loaded machine is many times slower than an idle one):
    # every prompt prefilled; 18 x ~530 tokens do not fit the pool at once, so two waves of 300 steps.
    work = (sum(len(p) for p in prompt.values()), 2 * 300)
    rate = speed(small_server)
    timeout = rate.timeout(*work)

    def one(item: tuple[str, str]) -> None:
        policy, how = item
        kv = {"policy": policy} if policy == "none" else {"policy": policy, "budget": 64}
        # The endpoint aborts a request that has compressed. With the step cap, 16 first compressions
        # of ~530 tokens at once run one per step, 3 steps each (split), pending plans first: 80 decode
        # steps cover them; the disconnects leave after 3 chunks, plans pending.
        rid = f"abort-{policy}-{how}"
        outcome, stats = abort_stream(small_server, prompt[item], kv, rid, how, 300, ENDPOINT_AFTER, timeout)
        with lock:
            results[item] = (outcome, stats["compressions"] if stats else -1)

    with (
        watchdog(small_server, "aborts", rate.expected(*work)),
        ThreadPoolExecutor(len(cases)) as ex,
    ):
        list(ex.map(one, cases))
    assert len(results) == len(cases)
    assert all(results[(p, "endpoint")][0] == "abort" for p in names), results
    # Every compressing request aborted by the endpoint had compressed its prompt: it was mid-compression.
    assert all(results[(p, "endpoint")][1] >= 1 for p in POLICIES), results
    # Healthy: fresh requests complete and compress.
    for i, p in enumerate(("snapkv", "d2o")):
        ids = chat_ids([{"role": "user", "content": long_text(400, seed=350 + i)}])
        out = small_server.generate(
            input_ids=ids, max_new_tokens=8, kv={"policy": p, "budget": 64}, timeout=timeout
        )
        assert kvinfo(out)["evicted"] > 0 and not kvinfo(out)["failed"]
    assert whole(small_server)["policy_failures"] == failures0
    assert len(tracebacks(small_server)) == before, tracebacks(small_server)[before:]


# ---- the watchdog's report -------------------------------------------------------------------------
def test_watchdog_report_names_a_running_request(small_server: Server):
    """What a late request's watchdog prints: the request in the running batch, with its progress and
    its compression state, and the scheduler's last steps."""
    whole(small_server)
    ids = chat_ids([{"role": "user", "content": long_text(300, seed=77)}])
    rid = "watchdog-probe"
    with stream(small_server, ids, {"policy": "snapkv", "budget": 64}, rid) as r:
        assert len(read_chunks(r.iter_lines(), 2)) == 2
        report = scheduler_report(small_server)
        requests.post(small_server.url + "/abort_request", json={"rid": rid}, timeout=60)
    queues = json.loads(report.split("\n", 1)[0])["queues"]
    mine = [q for q in queues["running"] + queues["waiting"] if q["rid"] == rid]
    assert len(mine) == 1 and mine[0]["input"] == len(ids) and mine[0]["output"] >= 1, queues
    assert mine[0]["kvevict"]["policy"] == "snapkv", mine
    assert "Prefill batch" in report, report
    whole(small_server)


# ---- a policy fault in the middle of a staged compaction ----------------------------------------------
def test_fault_after_staged_writes_leaves_the_request_on_intact_kv(small_server: Server):
    """`test_fault_staged` overwrites the plan's dense copies of the region in every layer, then raises at
    the last layer. The request must continue uncompressed on its intact KV (output equal to `none`), be
    counted once in `policy_failures`, and the tree must serve its prompt intact to the next request."""
    whole(small_server)
    failures0 = small_server.server_info()["internal_states"][0]["kvevict"]["policy_failures"]
    logged0 = small_server.log_path.read_text(errors="replace").count("RuntimeError: test_fault_staged")
    ids = chat_ids([{"role": "user", "content": long_text(700, seed=71) + "\nWhat is the last line?"}])
    out = small_server.generate(
        input_ids=ids, max_new_tokens=40, ignore_eos=True, kv={"policy": "test_fault_staged", "budget": 64}
    )
    info = kvinfo(out)
    assert info["failed"] and info["evicted"] == 0 and info["compressions"] == 0, info
    assert info["kv_tokens"] == info["logical_tokens"] == len(ids) + 39
    again = small_server.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, kv={"policy": "none"})
    assert again["meta_info"]["cached_tokens"] >= len(ids) - 1  # the tree kept the prompt: it is matched
    assert again["output_ids"] == out["output_ids"]
    whole(small_server)
    ref = small_server.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, kv={"policy": "none"})
    assert ref["meta_info"]["cached_tokens"] == 0 and ref["output_ids"] == out["output_ids"]
    state = whole(small_server)
    assert state["policy_failures"] == failures0 + 1  # once, though every decode step could have retried
    log = small_server.log_path.read_text(errors="replace")
    assert log.count("RuntimeError: test_fault_staged: deliberate failure after writing") == logged0 + 1


# ---- memory pressure ----------------------------------------------------------------------------------
N_NEW = 300


def test_memory_pressure_every_policy_retracts_and_finishes(small_server: Server):
    """Two long requests per policy (and `none`) at once in a 6,000-token pool, each keeping 90% of its
    history: decode outgrows the pool (18 x ~500 tokens), SGLang retracts, every request finishes with all
    its tokens, and nothing leaks."""
    whole(small_server)
    deferred0 = small_server.server_info()["internal_states"][0]["kvevict"]["compressions_deferred"]
    cases = [(p, j) for p in [*POLICIES, "none"] for j in range(2)]
    seeds = {c: 900 + i for i, c in enumerate(cases)}
    # Every request prefilled twice (a retraction re-prefills); 18 x ~520 tokens outgrow the pool, so
    # about three waves of N_NEW steps.
    work = (2 * len(cases) * (220 + N_NEW), 3 * N_NEW)
    rate = speed(small_server)
    timeout = rate.timeout(*work)

    def one(item: tuple[str, int]) -> tuple[str, int, dict]:
        policy = item[0]
        kv = {"policy": policy} if policy == "none" else {"policy": policy, "budget": "90%"}
        ids = chat_ids([{"role": "user", "content": long_text(200, seed=seeds[item])}])
        # min_new_tokens, not ignore_eos: SGLang reserves all of an ignore_eos request's tokens at admission
        out = small_server.generate(
            input_ids=ids, max_new_tokens=N_NEW, min_new_tokens=N_NEW, kv=kv, timeout=timeout
        )
        assert len(out["output_ids"]) == N_NEW, policy
        return policy, len(ids), out["meta_info"]

    with watchdog(small_server, "memory pressure", rate.expected(*work)):
        with ThreadPoolExecutor(len(cases)) as ex:
            runs = list(ex.map(one, cases))
    retracted: dict[str, int] = {}
    for policy, n_ids, meta in runs:
        retracted[policy] = retracted.get(policy, 0) + meta["num_retractions"]
        if policy != "none":
            info = meta["kvevict"][0]
            assert not info["failed"] and info["logical_tokens"] == n_ids + N_NEW - 1, (policy, info)
            assert info["evicted"] > 0, (policy, info)
    print("retractions per policy:", retracted)
    assert sum(retracted.values()) >= 3, retracted
    assert any(retracted[p] for p in POLICIES), retracted  # compressed requests were retracted too
    state = whole(small_server)
    print("compression checks deferred:", state["compressions_deferred"] - deferred0)


# ---- short soak ------------------------------------------------------------------------------------------
SOAK_N = 36


def test_short_soak(small_server: Server):
    failures0 = whole(small_server)["policy_failures"]
    before = len(tracebacks(small_server))
    info0 = small_server.server_info()["internal_states"][0]["kvevict"]  # counters are per server
    stats = run_soak(small_server.url, n=SOAK_N, concurrency=8, seed=11, max_prompt=900)
    print(stats.line())
    assert not stats.errors, stats.errors[:5]
    info = small_server.server_info()["internal_states"][0]["kvevict"]
    assert info["compressions_deferred"] > info0["compressions_deferred"], (info0, info)
    assert info["compressions_split"] > info0["compressions_split"], (info0, info)
    assert stats.finished + stats.aborted_disconnect + stats.aborted_endpoint == SOAK_N
    assert stats.aborted_disconnect + stats.aborted_endpoint >= 2
    assert stats.matched_compressed >= 1 and stats.compressed >= 10
    assert whole(small_server)["policy_failures"] == failures0
    assert len(tracebacks(small_server)) == before, tracebacks(small_server)[before:]
