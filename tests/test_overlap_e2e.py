"""The overlap scheduler stays on under compression, and changes nothing (real servers, real model).

Under overlap SGLang prepares step N (our compression included) before it has processed step N-1's
results; on a GPU the compaction is queued after forward N-1 on the stream. Here every op is synchronous,
so what this checks is the host side: the same requests, one at a time, compress at the same steps,
keep the same tokens and answer the same with overlap on (the `kv_server` fixture, SGLang's default) as
on a second server started with `--disable-overlap-schedule`, including a multi-turn session whose
next turn starts on the stored compressed history and a request that finishes at its budget.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sgl_kvevict.serve.serverproc import Server

from .helpers import POOL, _server, chat_ids, long_text

pytestmark = pytest.mark.server

POLICIES = [
    {"policy": "d2o", "budget": 96},
    {"policy": "snapkv", "budget": "40%"},
    {"policy": "lagkv", "budget": 64, "config": {"lag": 32}},
    {"policy": "criticalkv", "budget": 80},
    {"policy": "h2o", "budget": 64},
]


@pytest.fixture(scope="module")
def no_overlap_server() -> Iterator[Server]:
    """`kv_server`'s flags, with the overlap scheduler off."""
    yield from _server(
        [
            *POOL,
            "--kv-policy",
            "d2o",
            "--kv-budget",
            "256",
            "--chunked-prefill-size",
            "768",
            "--disable-overlap-schedule",
        ]
    )


def _run(srv: Server, kv: dict, seed: int) -> list[tuple[list[int], int, int]]:
    """One long prompt, then a two-turn session: (output ids, evicted, compressions) per request. Each
    policy gets its own texts (`seed`): a prompt another policy's request left in the tree would be a
    shared prefix, never compressed."""
    out = []
    ids = chat_ids([{"role": "user", "content": long_text(500, seed=seed) + "\nWhich step failed first?"}])
    first = srv.generate(input_ids=ids, max_new_tokens=40, kv=kv)
    msgs = [
        {"role": "user", "content": long_text(300, seed=seed + 1) + "\nSummarise."},
    ]
    turns = []
    for follow in ("And the second half?", "Name one error code."):
        o = srv.generate(input_ids=chat_ids(msgs), max_new_tokens=24, kv=kv)
        turns.append(o)
        msgs += [{"role": "assistant", "content": o["text"]}, {"role": "user", "content": follow}]
    for o in [first, *turns]:
        info = o["meta_info"]["kvevict"][0]
        out.append((o["output_ids"], info["evicted"], info["compressions"]))
    return out


def test_overlap_is_on_under_a_policy(kv_server: Server):
    import requests

    info = requests.get(kv_server.url + "/server_info", timeout=30).json()
    assert info["disable_overlap_schedule"] is False


@pytest.mark.parametrize("kv", POLICIES, ids=[p["policy"] for p in POLICIES])
def test_overlap_on_equals_off(kv_server: Server, no_overlap_server: Server, kv: dict):
    import requests

    seed = 100 + 10 * [p["policy"] for p in POLICIES].index(kv["policy"])
    # both trees empty: what a request shares depends on what earlier requests left there, and the
    # session-wide server has served other tests
    for srv in (kv_server, no_overlap_server):
        assert requests.post(srv.url + "/flush_cache", timeout=60).status_code == 200
    on = _run(kv_server, kv, seed)
    off = _run(no_overlap_server, kv, seed)
    assert any(evicted > 0 for _, evicted, _ in on), "nothing was evicted: the check would be empty"
    assert on == off
