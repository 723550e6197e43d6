"""The operator's override controls on a real server: denied overrides are HTTP 400 naming the flag, on
the native and the OpenAI endpoints; allowed ones run with what they asked for; the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from sgl_kvevict.serve.serverproc import Server

from .helpers import POOL, _server, chat_ids, long_text

pytestmark = [pytest.mark.server, pytest.mark.long]


@pytest.fixture(scope="module")
def ruled_server() -> Iterator[Server]:
    yield from _server(
        [
            *POOL,
            "--kv-policy",
            "d2o",
            "--kv-budget",
            "256",
            "--kv-overrides",
            '{"policies": "lagkv,snapkv", "min_budget": "128,0.25"}',
        ]
    )


def _generate(srv: Server, kv: dict, text: str = "hello") -> requests.Response:
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "custom_params": {"kvevict": kv}},
    }
    return requests.post(srv.url + "/generate", json=body, timeout=600)


def _chat(srv: Server, kv: dict, content: str = "hi") -> requests.Response:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        "custom_params": {"kvevict": kv},  # what the python client's extra_body sends
        "return_meta_info": True,
    }
    return requests.post(srv.url + "/v1/chat/completions", json=body, timeout=600)


def test_operator_rules_over_http(ruled_server: Server):
    srv = ruled_server
    denied = [
        ({"policy": "h2o"}, "--kv-overrides policies lagkv,snapkv"),
        ({"policy": "none"}, "--kv-overrides policies"),
        ({"budget": 64}, "--kv-overrides min_budget"),
        ({"policy": "lagkv", "budget": 0.1}, "--kv-overrides min_budget"),
        ({"policy": "snapkv", "config": {"window": 64}}, "'window' (64)"),
    ]
    for kv, needle in denied:
        r = _generate(srv, kv)
        assert r.status_code == 400 and needle in r.text, (kv, r.status_code, r.text[:300])
        r = _chat(srv, kv)
        assert r.status_code == 400 and needle in r.text, (kv, r.status_code, r.text[:300])

    # allowed: a listed policy, the server's own policy, budgets at or above the minimum of their kind
    # (a fresh prompt each: a repeated one would match the tree and leave nothing of its own to evict)
    allowed = [
        ({"policy": "lagkv", "budget": 128, "config": {"lag": 32}}, "lagkv"),
        ({"policy": "snapkv", "budget": 0.25}, "snapkv"),
        ({"policy": "d2o", "budget": 300}, "d2o"),
        ({"budget": 0.5}, "d2o"),
    ]
    for i, (kv, policy) in enumerate(allowed):
        ids = chat_ids(
            [{"role": "user", "content": long_text(700, seed=71 + i) + "\nWhat is the last line?"}]
        )
        out = srv.generate(input_ids=ids, max_new_tokens=4, kv=kv)
        info = out["meta_info"]["kvevict"][0]
        assert info["policy"] == policy and info["budget"] == kv.get("budget", 256), (kv, info)
        assert info["evicted"] > 0 and not info["failed"], (kv, info)
    text = long_text(700, seed=79) + "\nWhat is the last line?"
    r = _chat(srv, {"policy": "snapkv", "budget": 200}, content=text)
    assert r.status_code == 200, r.text[:300]
    meta = r.json()["choices"][0]["meta_info"]["kvevict"][0]
    assert meta["policy"] == "snapkv" and meta["evicted"] > 0, meta

    # still serving, and nothing leaked
    assert srv.generate("The capital of France is", max_new_tokens=3)["text"].strip()
    srv.flush()
    state = srv.server_info()["internal_states"][0]["kvevict"]
    assert state["available_tokens"] == state["max_total_tokens"]
