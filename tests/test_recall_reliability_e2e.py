"""The host tier under the failure modes of a real server: requests aborted while they recall in every
decode step, and memory pressure that retracts requests holding host entries. One small server with
recall on (`--kv-recall-tokens`), SGLang's leak checks on; after each test both pools must be whole once
flushed (every device slot free, no host column in use), with no traceback in the log."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_kvevict.serve.serverproc import Server

from .helpers import _server, chat_ids, host_state, long_text, speed, watchdog
from .test_reliability_e2e import abort_stream, flush_until_whole, tracebacks

pytestmark = [pytest.mark.server, pytest.mark.long]

POOL_TOKENS, HOST_TOKENS, RECALL = 2600, 8000, 64
POLICIES = ["snapkv", "d2o", "lagkv", "knorm"]


@pytest.fixture(scope="module")
def recall_small() -> Iterator[Server]:
    yield from _server(
        [
            "--max-total-tokens",
            str(POOL_TOKENS),
            "--kv-policy",
            "snapkv",
            "--kv-policy-config",
            '{"scope": "branch"}',
            "--kv-recall-tokens",
            str(RECALL),
            "--kv-host-tokens",
            str(HOST_TOKENS),
            "--kv-recall-config",
            '{"every": 1}',  # decode steps recall too: aborts and retractions must meet them mid-step
            "--chunked-prefill-size",
            "1024",
            # admit on a small estimate of future tokens: decode outgrows the pool, SGLang retracts
            "--schedule-conservativeness",
            "0.1",
        ]
    )


def whole(srv: Server) -> dict:
    """Both tiers whole after a flush: every device slot free, no host column held by anyone."""
    state = flush_until_whole(srv.url)
    assert state["available_tokens"] == state["max_total_tokens"] == POOL_TOKENS, state
    h = host_state(srv)
    assert h["host_used"] == 0 and h["host_branches"] == 0, h
    return h


def test_aborts_while_recalling_leave_both_pools_whole(recall_small: Server):
    """Per policy, a stream closed by the client and a stream aborted through /abort_request while it
    recalls in every decode step (its 500-token prompt compressed to 64 at prefill: the rest is on the
    host); all at once. They end as aborted, the server keeps recalling, nothing leaks on either tier."""
    before = len(tracebacks(recall_small))
    failures0 = whole(recall_small)["recall_failures"]
    cases = [(p, h) for p in POLICIES for h in ("disconnect", "endpoint")]
    prompt = {
        c: chat_ids([{"role": "user", "content": long_text(500, seed=700 + i)}]) for i, c in enumerate(cases)
    }
    work = (sum(len(p) for p in prompt.values()), 2 * 200)
    rate = speed(recall_small)
    timeout = rate.timeout(*work)
    results: dict[tuple[str, str], tuple[str, int]] = {}
    lock = threading.Lock()

    def one(item: tuple[str, str]) -> None:
        policy, how = item
        kv = {"policy": policy, "budget": 64}
        rid = f"recall-abort-{policy}-{how}"
        outcome, stats = abort_stream(recall_small, prompt[item], kv, rid, how, 200, 23, timeout)
        with lock:
            results[item] = (outcome, stats["recalled"] if stats else -1)

    with (
        watchdog(recall_small, "aborts while recalling", rate.expected(*work)),
        ThreadPoolExecutor(len(cases)) as ex,
    ):
        list(ex.map(one, cases))
    assert all(results[(p, "endpoint")][0] == "abort" for p in POLICIES), results
    # each request aborted by the endpoint had recalled before the abort: it was recalling
    assert all(results[(p, "endpoint")][1] > 0 for p in POLICIES), results
    h = whole(recall_small)
    assert h["recall_failures"] == failures0, h
    # the server still recalls
    ids = chat_ids([{"role": "user", "content": long_text(500, seed=790)}])
    out = recall_small.generate(input_ids=ids, max_new_tokens=8, kv={"policy": "snapkv", "budget": 64})
    info = out["meta_info"]["kvevict"][0]
    assert info["recalled"] > 0 and not info["failed"], info
    whole(recall_small)
    assert len(tracebacks(recall_small)) == before, tracebacks(recall_small)[before:]


N_NEW = 150
# lagkv's partitions of 32 tokens: it evicts (and demotes) from the prefill on, as the others do
KV = {"lagkv": {"lag": 32}}


def test_memory_pressure_retracts_requests_holding_host_entries(recall_small: Server):
    """Four long requests per policy at once in a 2,600-token pool, each keeping 90% of its history on the
    device and demoting the rest: decode outgrows the pool, SGLang retracts requests that hold host
    entries, every request finishes with all its tokens and still recalled, and nothing leaks on either
    tier (a retracted request keeps its host entries, or gives them back, never both or neither)."""
    before = len(tracebacks(recall_small))
    failures0 = whole(recall_small)["recall_failures"]
    cases = [(p, j) for p in POLICIES for j in range(4)]
    seeds = {c: 950 + i for i, c in enumerate(cases)}
    # about 7 run at once in the pool: three waves of N_NEW steps, and the retracted ones again
    work = (2 * len(cases) * (220 + N_NEW), 4 * N_NEW)
    rate = speed(recall_small)
    timeout = rate.timeout(*work)

    def one(item: tuple[str, int]) -> tuple[str, int, dict]:
        policy = item[0]
        ids = chat_ids([{"role": "user", "content": long_text(200, seed=seeds[item])}])
        out = recall_small.generate(
            input_ids=ids,
            max_new_tokens=N_NEW,
            min_new_tokens=N_NEW,
            kv={"policy": policy, "budget": "90%", "config": KV.get(policy, {})},
            timeout=timeout,
        )
        assert len(out["output_ids"]) == N_NEW, policy
        return policy, len(ids), out["meta_info"]

    with watchdog(recall_small, "memory pressure with recall", rate.expected(*work)):
        with ThreadPoolExecutor(len(cases)) as ex:
            runs = list(ex.map(one, cases))
    retracted = 0
    for policy, n_ids, meta in runs:
        retracted += meta["num_retractions"]
        info = meta["kvevict"][0]
        assert not info["failed"] and info["logical_tokens"] == n_ids + N_NEW - 1, (policy, info)
        assert info["evicted"] > 0 and info["recalled"] > 0, (policy, info)
    print("retractions:", retracted)
    assert retracted >= 1, retracted
    h = whole(recall_small)
    assert h["recall_failures"] == failures0, h
    assert len(tracebacks(recall_small)) == before, tracebacks(recall_small)[before:]
