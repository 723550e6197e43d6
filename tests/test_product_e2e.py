"""The product as users run it: one server started exactly as `make serve` starts it (`sgl_kvevict.launch`'s
command and environment, the Makefile's default policy and budget, recall on through ARGS), with none of
the test-only settings the other end-to-end tests use: no `KVEVICT_LOAD` (which registers the
test policies and wraps the recall stage's `exchange` and `append_layer` for every policy) and no
`KVEVICT_DEBUG`. SGLang's leak checks stay on, as in every test (`CHECKED_ENV` less the two settings).

The core checks run quickly on it: compression, recall in branch scope, isolation of two concurrent
requests with different policies, and aborts (client disconnect and `/abort_request`) that leave the
server healthy with every slot back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sgl_kvevict.serve.serverproc import Server

from .helpers import CHECKED_ENV, POOL, START_TIMEOUT, chat_ids, host_state, long_text
from .test_recall_e2e import FACT, fillers, session
from .test_reliability_e2e import abort_stream, tracebacks

pytestmark = pytest.mark.server

TEST_ONLY = ("KVEVICT_LOAD", "KVEVICT_DEBUG")
# `make serve`'s defaults (POLICY=lagkv, BUDGET=0.5); ARGS turns the host tier and recall on, and sizes
# the KV pool as every test server does (POOL): the CPU default `--mem-fraction-static 0.1` sizes it from
# the memory free at start, and a shared machine with 10.6 GB free refused to start with it ("Loaded
# weights leave no GPU memory for the KV cache under --mem-fraction-static=0.1").
MAKE_SERVE = ["--kv-policy", "lagkv", "--kv-budget", "0.5"]
# recall at its defaults: the prefill over both tiers, the append, and every decode step's recall
ARGS = [*POOL, "--kv-recall-tokens", "64", "--kv-host-tokens", "1500"]
BRANCH = {"policy": "snapkv", "budget": 64, "config": {"scope": "branch"}}


@pytest.fixture(scope="module")
def product_server() -> Iterator[Server]:
    env = {k: v for k, v in CHECKED_ENV.items() if k not in TEST_ONLY}
    with pytest.MonkeyPatch.context() as mp:
        for k in TEST_ONLY:  # nor inherited from the environment the tests run in
            mp.delenv(k, raising=False)
        srv = Server([*MAKE_SERVE, *ARGS], env=env, timeout=START_TIMEOUT)
        assert not any(k in srv.env for k in TEST_ONLY), {k: srv.env[k] for k in TEST_ONLY if k in srv.env}
        srv.start()
        try:
            yield srv
        finally:
            alive, tail = srv.alive(), srv.tail()
            srv.stop()
            assert alive, f"server died during the tests; log tail:\n{tail}"


def pool(srv: Server) -> dict:
    return srv.server_info()["internal_states"][0]["kvevict"]


def whole(srv: Server) -> dict:
    """Flush until nothing is held (aborted requests may still be leaving): every slot back."""
    state = pool(srv)
    for _ in range(120):
        r = requests.post(srv.url + "/flush_cache", timeout=60)
        state = pool(srv)
        if r.status_code == 200 and state["available_tokens"] == state["max_total_tokens"]:
            break
        threading.Event().wait(1.0)
    assert state["available_tokens"] == state["max_total_tokens"], state
    assert state["live_request_states"] == 0 and state["capture_rings"] == 0, state
    return state


def _raw(srv: Server, kv: dict) -> requests.Response:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "custom_params": {"kvevict": kv}}}
    return requests.post(srv.url + "/generate", json=body, timeout=600)


def test_the_server_runs_without_test_settings(product_server: Server):
    """The server process's environment has no test-only setting and SGLang's leak checks on (idle and
    busy), and a request naming a test-only policy is refused (HTTP 400): the policies were never registered, so nothing wraps the recall stage."""
    raw = Path(f"/proc/{product_server.proc.pid}/environ").read_bytes().split(b"\0")
    env = dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)
    assert not set(env) & set(TEST_ONLY), {k: env[k] for k in TEST_ONLY if k in env}
    checks = ("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY")
    assert all(env.get(k) == "1" for k in checks), {k: env.get(k) for k in checks}
    for name in ("test_raise", "test_recall_fault", "test_fault_staged"):
        r = _raw(product_server, {"policy": name})
        assert r.status_code == 400 and name in r.text, (name, r.status_code, r.text[:300])
    assert _raw(product_server, {"policy": "snapkv", "budget": 64}).status_code == 200
    info = pool(product_server)
    assert info["policy"] == "lagkv" and "queues" not in info and "python_objects" not in info, info


def test_a_long_prompt_is_compressed(product_server: Server):
    """The server's own policy (no override): a 1,200-token prompt under budget 0.5 is evicted, and
    `meta_info` and the server's totals say so. The server recalls and names no scope: branch scope."""
    before = pool(product_server)
    ids = chat_ids([{"role": "user", "content": long_text(1200, seed=7)}])
    out = product_server.generate(input_ids=ids, max_new_tokens=8)
    info = out["meta_info"]["kvevict"][0]
    assert info["policy"] == "lagkv" and info["scope"] == "branch" and not info["failed"], info
    assert info["evicted"] > 0 and info["kv_tokens"] < info["logical_tokens"], info
    after = pool(product_server)
    assert after["compressions"] > before["compressions"], (before, after)
    assert after["tokens_evicted"] >= before["tokens_evicted"] + info["evicted"], (before, after)
    whole(product_server)


def test_recall_in_branch_scope(product_server: Server):
    """A fact, two filler turns under a 64-token branch budget (snapkv), then a question, recall at its
    defaults: the question's append brings host entries back, its decode steps recall (in every layer
    and KV head), and the host tier's counters move by the request's own numbers."""
    product_server.flush()
    before = host_state(product_server)
    turns = [FACT, *fillers(111, 2), "What is the vault code? Answer with the number only."]
    infos, _ = session(product_server, BRANCH, turns)
    q = infos[-1]
    assert q["scope"] == "branch" and q["host_tokens"] > 0 and q["recalled"] > 0, q
    assert all(not r["failed"] for r in infos), infos
    after = host_state(product_server)
    assert after["demoted"] > before["demoted"], (before, after)
    assert after["recalls"] > before["recalls"], (before, after)
    assert after["recalled"] >= before["recalled"] + q["recalled"], (before, after)
    assert after["recall_failures"] == before["recall_failures"], (before, after)
    assert after["decode_steps"] > before["decode_steps"] and len(q["output_ids"]) > 1, (before, after, q)
    whole(product_server)


def test_concurrent_requests_keep_their_own_policy(product_server: Server):
    """Two requests at once, one snapkv and one d2o (and the server's lagkv beside them): each reports
    its own policy and compressed its own prompt."""
    kvs = [{"policy": "snapkv", "budget": 64}, {"policy": "d2o", "budget": 64}, None]
    prompts = [chat_ids([{"role": "user", "content": long_text(700, seed=60 + i)}]) for i in range(3)]

    def one(i: int) -> dict:
        out = product_server.generate(input_ids=prompts[i], max_new_tokens=16, ignore_eos=True, kv=kvs[i])
        return out["meta_info"]["kvevict"][0]

    with ThreadPoolExecutor(3) as ex:
        infos = list(ex.map(one, range(3)))
    assert [r["policy"] for r in infos] == ["snapkv", "d2o", "lagkv"], infos
    assert all(r["evicted"] > 0 and not r["failed"] for r in infos), infos
    # budget 64 (+ sinks and recent) for the overrides; the server's 0.5 keeps far more
    assert infos[0]["kv_tokens"] < infos[2]["kv_tokens"] and infos[1]["kv_tokens"] < infos[2]["kv_tokens"]
    whole(product_server)


def test_aborts_leave_the_server_healthy(product_server: Server):
    """A stream the client closes and a stream aborted through `/abort_request`, both compressing, at
    once: the aborted one ends as aborted, a fresh request still compresses, no traceback is logged, and
    once idle every slot is back (SGLang's idle check would have killed the scheduler otherwise)."""
    before = len(tracebacks(product_server))
    failures = pool(product_server)["policy_failures"]
    prompt = {
        h: chat_ids([{"role": "user", "content": long_text(500, seed=90 + i)}]) for i, h in enumerate("ab")
    }
    kv = {"policy": "snapkv", "budget": 64}
    cases = [("a", "disconnect"), ("b", "endpoint")]

    def one(case: tuple[str, str]) -> tuple[str, dict | None]:
        key, how = case
        return abort_stream(product_server, prompt[key], kv, f"product-{how}", how, 200, 40, 1200)

    with ThreadPoolExecutor(2) as ex:
        results = dict(zip([h for _, h in cases], ex.map(one, cases), strict=True))
    assert results["disconnect"][0] == "closed", results
    assert results["endpoint"][0] == "abort" and results["endpoint"][1]["compressions"] >= 1, results
    whole(product_server)
    ids = chat_ids([{"role": "user", "content": long_text(500, seed=99)}])
    out = product_server.generate(input_ids=ids, max_new_tokens=8, kv=kv)
    assert out["meta_info"]["kvevict"][0]["evicted"] > 0
    whole(product_server)
    assert pool(product_server)["policy_failures"] == failures
    assert len(tracebacks(product_server)) == before, tracebacks(product_server)[before:]
    assert product_server.alive()
