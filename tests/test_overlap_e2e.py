"""The overlap scheduler stays on under compression, and changes nothing (real servers, real model).

Under overlap SGLang prepares step N (our compression included) before it has processed step N-1's
results; on a GPU the compaction is queued after forward N-1 on the stream. Here every op is synchronous,
so what this checks is the host side: the same requests, one at a time, compress at the same steps,
keep the same tokens and answer the same with overlap on (the `kv_server` fixture, SGLang's default) as
on a second server started with `--disable-overlap-schedule`, including a multi-turn session whose
next turn starts on the stored compressed history and a request that finishes at its budget.

Compression is compared exactly, down to the positions each layer and KV head keeps (KVEVICT_DEBUG=1
timelines). Greedy tokens may part only where both servers' top two candidates are within `TIE` of
each other and swapped: a rounding flip, which the failure message tells apart from a real difference.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sgl_kvevict.serve.serverproc import Server

from .helpers import POOL, _server, chat_ids, long_text

pytestmark = [pytest.mark.server, pytest.mark.long]

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


# A flip between two near-equal candidates is rounding, not a scheduler difference: bf16 logits near 10
# are 0.0625 apart, and both servers' top two are then within this many nats of each other.
TIE = 0.1


def _gen(srv: Server, ids: list[int], n: int, kv: dict) -> dict:
    """Greedy, with each step's top-2 log-probabilities (to tell a near tie from a real divergence)."""
    import requests

    body = {
        "input_ids": ids,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "custom_params": {"kvevict": kv}},
    }
    r = requests.post(srv.url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def _run(srv: Server, kv: dict, seed: int) -> list[dict]:
    """One long prompt, then a two-turn session (one request at a time: a fixed schedule). Each policy
    gets its own texts (`seed`): a prompt another policy's request left in the tree would be a shared
    prefix, never compressed."""
    ids = chat_ids([{"role": "user", "content": long_text(500, seed=seed) + "\nWhich step failed first?"}])
    outs = [_gen(srv, ids, 40, kv)]
    msgs = [{"role": "user", "content": long_text(300, seed=seed + 1) + "\nSummarise."}]
    for follow in ("And the second half?", "Name one error code."):
        o = _gen(srv, chat_ids(msgs), 24, kv)
        outs.append(o)
        msgs += [{"role": "assistant", "content": o["text"]}, {"role": "user", "content": follow}]
    return outs


def _compression(o: dict, tokens: int | None = None) -> dict:
    """What compression did for a request: counts, the prefix it matched, and (KVEVICT_DEBUG=1) the
    positions each layer and KV head kept at every event, up to `tokens` logical tokens."""
    info = o["meta_info"]["kvevict"][0]
    timeline = info["kept_timeline"]
    if tokens is not None:
        timeline = [ev for ev in timeline if ev["tokens"] <= tokens]
    out = {"timeline": timeline, "cached": o["meta_info"]["cached_tokens"]}
    if tokens is None:
        out |= {k: info[k] for k in ("evicted", "compressions", "reused_evicted", "prefix_kv_tokens")}
    return out


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def _near_tie(on: dict, off: dict, i: int) -> tuple[bool, float, float]:
    """At step `i`: the two servers chose each other's second choice, each by at most `TIE` nats."""
    top_on = on["meta_info"]["output_top_logprobs"][i]
    top_off = off["meta_info"]["output_top_logprobs"][i]
    gap_on, gap_off = top_on[0][0] - top_on[1][0], top_off[0][0] - top_off[1][0]
    swapped = top_on[0][1] == top_off[1][1] and top_off[0][1] == top_on[1][1]
    return swapped and gap_on <= TIE and gap_off <= TIE, gap_on, gap_off


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
    assert any(o["meta_info"]["kvevict"][0]["evicted"] > 0 for o in on), (
        "nothing was evicted: the check would be empty"
    )
    for k, (a, b) in enumerate(zip(on, off, strict=True)):
        i = _first_diff(a["output_ids"], b["output_ids"])
        if i is None:
            assert len(a["output_ids"]) == len(b["output_ids"]), k
            # Same tokens: compression must have done exactly the same (counts, matched prefix, and
            # the kept positions of every layer and head at every event).
            assert _compression(a) == _compression(b), f"request {k}: compression differs"
            continue
        # Greedy tokens may part at a near tie (the same computation rounded differently); anything
        # else is a difference between the schedulers. What was compressed before that point must agree.
        tie, gap_on, gap_off = _near_tie(a, b, i)
        assert tie, f"request {k} differs at token {i}: top-2 gaps {gap_on:.4f} (on), {gap_off:.4f} (off)"
        seen = a["meta_info"]["prompt_tokens"] + i - 1  # the tokens behind token i's logits
        assert _compression(a, seen) == _compression(b, seen), f"request {k}: compression differs"
        print(f"request {k}: a near tie at token {i} (gaps {gap_on:.4f}, {gap_off:.4f})")
        if k >= 1:
            break  # the session's next turn holds this turn's text: it differs from here on
