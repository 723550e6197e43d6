"""Decode-time suffix compression inside the live SGLang server (real model, HTTP, leak checks on).

One compressing server (`--kv-policy d2o --kv-budget 256`) serves every test; other policies and budgets
come per request through `custom_params`, as a user of one shared server would send them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import sglang as sgl

from sgl_kvevict.serve.serverproc import Server

from .helpers import chat_ids, long_text, not_collapsed, tokenizer

pytestmark = pytest.mark.server

SINKS, RECENT = 4, 32
NO_EVICT = {"budget": 100000}


def kvinfo(out: dict) -> dict:
    return out["meta_info"]["kvevict"][0]


def run_parallel(fn, items):
    with ThreadPoolExecutor(len(items)) as ex:
        return list(ex.map(fn, items))


def conversation(srv: Server, kv: dict, turns: list[str], n: int) -> list[list[int]]:
    msgs: list[dict] = []
    outs = []
    for text in turns:
        msgs.append({"role": "user", "content": text})
        out = srv.generate(input_ids=chat_ids(msgs), max_new_tokens=n, kv=kv)
        outs.append(out["output_ids"])
        msgs.append({"role": "assistant", "content": out["text"]})
    return outs


# ---- 1. nothing evicted => token-identical to the full cache --------------------------------------
def test_no_eviction_is_token_identical_single_and_multiturn(kv_server: Server):
    """Each side starts from an empty tree, so neither prefills over the other's cached prefix."""
    ids = chat_ids([{"role": "user", "content": long_text(400, seed=3) + "\nWhat happened last?"}])

    def fresh(kv: dict) -> dict:
        kv_server.flush()
        return kv_server.generate(input_ids=ids, max_new_tokens=32, kv=kv)

    ref, got = fresh({"policy": "none"}), fresh(NO_EVICT)
    assert got["output_ids"] == ref["output_ids"]
    assert kvinfo(got)["evicted"] == 0 and kvinfo(got)["policy"] == "d2o"
    turns = ["Name three colours.", "Which of them is the warmest?", "Say it in French."]
    kv_server.flush()
    with_policy = conversation(kv_server, NO_EVICT, turns, 16)
    kv_server.flush()
    assert with_policy == conversation(kv_server, {"policy": "none"}, turns, 16)


def test_no_eviction_is_token_identical_batch_of_8(kv_server: Server):
    """The 8 prompts go to an empty tree as one batched request, so the scheduler gets them at once and
    each side decodes the same batch in the same order. Eight separate requests would be batched as they
    arrive, and where the CPU's bf16 products depend on the batch (AMX) that alone changes tokens;
    `none` against `none` under the same conditions shows the comparison holds here."""
    prompts = [
        chat_ids([{"role": "user", "content": f"Tell me fact number {i} about {w}."}])
        for i, w in enumerate("abcdefgh")
    ]

    def run(kv: dict) -> list[list[int]]:
        kv_server.flush()
        body = {
            "input_ids": prompts,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "custom_params": {"kvevict": kv}},
        }
        r = requests.post(kv_server.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        outs = r.json()
        assert len(outs) == len(prompts) and all(kvinfo(o)["evicted"] == 0 for o in outs)
        return [o["output_ids"] for o in outs]

    ref = run({"policy": "none"})
    assert run({"policy": "none"}) == ref, "none against none differs: the server is not deterministic here"
    assert run(NO_EVICT) == ref


# ---- 2. every policy compresses a long request after prefill and during decode -------------------
POLICIES = {
    "streaming": {},
    "snapkv": {},
    "lagkv": {"lag": 32},
    "d2o": {},
    "graphkv": {},
    "criticalkv": {},
}


def window_of(policy: str, cfg: dict) -> int:
    return 2 * cfg["lag"] - 1 if policy == "lagkv" else RECENT


SIX_NEW = 120


@pytest.mark.long
def test_six_policies_at_once_hold_their_budget(kv_server: Server):
    prompts = {
        n: chat_ids(
            [{"role": "user", "content": long_text(2000, seed=50 + i) + "\nSummarize the log above."}]
        )
        for i, n in enumerate(POLICIES)
    }
    state0 = kv_server.server_info()["internal_states"][0]["kvevict"]  # counters are per server

    def one(item):
        name, cfg = item
        kv = {"policy": name, "budget": 256, "config": cfg}
        return name, kv_server.generate(
            input_ids=prompts[name], max_new_tokens=SIX_NEW, ignore_eos=True, kv=kv, timeout=3600
        )

    results = dict(run_parallel(one, list(POLICIES.items())))
    for name, out in results.items():
        info = kvinfo(out)
        assert info["policy"] == name and not info["failed"]
        assert info["compressions"] >= 2, (name, info)  # after prefill and during decode
        bound = 256 + window_of(name, POLICIES[name]) + SINKS
        assert info["kv_tokens"] - info["prefix_kv_tokens"] <= bound, (name, info)  # the shared prefix aside
        assert info["logical_tokens"] == len(prompts[name]) + SIX_NEW - 1
        assert len(out["output_ids"]) == SIX_NEW and not_collapsed(out["output_ids"]), (name, out["text"])
    # CriticalKV read every ||v W_O||_1 from the per-slot statistic the forward wrote (slotstats): its
    # last compression computed none (recomputing would have computed at least the newest tokens')
    computed = kvinfo(results["criticalkv"])["layer_criticalkv_vo_computed"]
    assert len(computed) == 30 and sum(computed) == 0, computed
    kv_server.flush()
    state = kv_server.server_info()["internal_states"][0]["kvevict"]
    assert state["available_tokens"] == state["max_total_tokens"]
    assert state["compressions"] - state0["compressions"] >= 12, (state0, state)
    assert state["slots_freed"] - state0["slots_freed"] > 6 * 1500, (state0, state)


def test_lagkv_budget_covering_the_request_keeps_everything(kv_server: Server):
    """LagKV at "100%" or at more tokens than the request holds every token, as every policy does
    (its per-partition ratio used to apply whatever the budget: 53% held at budget 1.0)."""
    ids = chat_ids([{"role": "user", "content": long_text(600, seed=77) + "\nSummarize the log above."}])
    for budget in ("100%", 1 << 20):
        out = kv_server.generate(
            input_ids=ids, max_new_tokens=8, kv={"policy": "lagkv", "budget": budget, "config": {"lag": 32}}
        )
        info = kvinfo(out)
        assert info["policy"] == "lagkv" and info["evicted"] == 0, (budget, info)
        assert info["kv_tokens"] == info["logical_tokens"], (budget, info)


# ---- 3. a shared prefix stays bit-identical and shared --------------------------------------------
def test_shared_prefix_is_intact_and_reused(kv_server: Server):
    system = {"role": "system", "content": long_text(1000, seed=11)}
    outs = []
    for q in (long_text(600, seed=12), long_text(600, seed=13)):
        ids = chat_ids([system, {"role": "user", "content": q + "\nWhich worker appears most?"}])
        outs.append(kv_server.generate(input_ids=ids, max_new_tokens=24))
    first, second = kvinfo(outs[0]), kvinfo(outs[1])
    assert first["evicted"] > 0 and second["evicted"] > 0  # both compressed their own suffix
    assert outs[1]["meta_info"]["cached_tokens"] >= 1000
    assert second["prefix_kv_tokens"] >= 1000
    assert second["prefix_digest"] and second["prefix_digest"] == second["prefix_digest_end"]


# ---- 4. multi-turn reuse through the OpenAI chat API ----------------------------------------------
def test_multiturn_openai_chat_reuses_compressed_history(kv_server: Server):
    msgs: list[dict] = [{"role": "system", "content": "You are a helpful operations assistant."}]
    extra = {"custom_params": {"kvevict": {"policy": "lagkv", "budget": 0.5}}, "return_meta_info": True}
    turns = []
    for i in range(4):
        msgs.append(
            {
                "role": "user",
                "content": long_text(500, seed=20 + i) + f"\nQuestion {i}: which status is most common?",
            }
        )
        body = {"model": "default", "messages": msgs, "max_tokens": 16, "temperature": 0, **extra}
        r = requests.post(kv_server.url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        j = r.json()
        meta = j["choices"][0]["meta_info"]
        turns.append(
            (
                j["usage"]["prompt_tokens"],
                j["usage"]["completion_tokens"],
                meta["cached_tokens"],
                meta["kvevict"][0],
            )
        )
        msgs.append({"role": "assistant", "content": j["choices"][0]["message"]["content"]})
    for k in range(1, 4):
        prev_prompt, prev_completion = turns[k - 1][0], turns[k - 1][1]
        prompt, _, cached, info = turns[k]
        # Earlier turns come from the tree; the re-rendered reply may re-tokenize differently at its end.
        assert cached >= prev_prompt and cached >= 0.95 * (prev_prompt + prev_completion), (k, turns[k])
        assert prompt - cached <= 560  # only the new user turn (+ template tokens) is prefilled
        assert info["reused_evicted"] > 0  # the matched history was compressed
    last = turns[-1][3]
    assert last["kv_tokens"] <= 0.7 * last["logical_tokens"], last


# ---- 5. an SGLang frontend program that forks ----------------------------------------------------
def test_frontend_fork_shares_the_context(kv_server: Server):
    context = long_text(700, seed=31)

    @sgl.function
    def branches(s, ctx):
        s += sgl.system("Answer in a few words.")
        s += sgl.user(ctx)
        s += sgl.assistant("I have read the log.")
        s.text()  # commits the shared prefix before forking, or the branches miss the cache
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += sgl.user(f"Question {i}: name one worker from the log.")
            f += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))
        return [f["answer"] for f in forks], [f.get_meta_info("answer") for f in forks]

    backend = sgl.RuntimeEndpoint(kv_server.url, chat_template_name="chatml")
    state = branches.run(ctx=context, backend=backend)
    answers, metas = state.ret_value
    assert len(answers) == 4 and all(a.strip() for a in answers)
    n_ctx = len(tokenizer().encode(context))
    for m in metas:
        assert m["cached_tokens"] >= n_ctx, m
        assert m["kvevict"][0]["policy"] == "d2o"


# ---- 6. a failing policy degrades only its request ------------------------------------------------
def test_policy_failure_leaves_request_uncompressed_and_server_healthy(kv_server: Server):
    """Both sides start from an empty tree, so they prefill the same lengths: where the CPU's bf16
    products depend on a batch's shape (AMX), a request that found the chat template's prefix cached
    would prefill fewer tokens and could flip a near-tied token."""
    ids = chat_ids([{"role": "user", "content": long_text(600, seed=41) + "\nWhat is the last line?"}])
    failures0 = kv_server.server_info()["internal_states"][0]["kvevict"]["policy_failures"]
    kv_server.flush()
    out = kv_server.generate(input_ids=ids, max_new_tokens=16, kv={"policy": "test_raise", "budget": 64})
    info = kvinfo(out)
    assert info["failed"] and info["evicted"] == 0 and info["kv_tokens"] == info["logical_tokens"]
    kv_server.flush()
    ref = kv_server.generate(input_ids=ids, max_new_tokens=16, kv={"policy": "none"})
    assert out["output_ids"] == ref["output_ids"]
    other = chat_ids([{"role": "user", "content": long_text(600, seed=42) + "\nWhat is the last line?"}])
    ok = kv_server.generate(input_ids=other, max_new_tokens=4, kv={"policy": "snapkv", "budget": 64})
    assert kvinfo(ok)["evicted"] > 0
    assert kv_server.server_info()["internal_states"][0]["kvevict"]["policy_failures"] > failures0


def test_bad_per_request_override_is_http_400(kv_server: Server):
    for bad, word in [
        ({"policy": "nope"}, "valid choices"),
        ({"budget": 7.5}, "budget"),
        ({"policy": "lagkv", "config": {"lag": 0}}, "lag"),
    ]:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "custom_params": {"kvevict": bad}}}
        r = requests.post(kv_server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 400 and word in r.text, (bad, r.status_code, r.text[:300])
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "hi"}],
        "custom_params": {"kvevict": {"policy": "nope"}},
    }
    r = requests.post(kv_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "valid choices" in r.text
    assert kv_server.generate("The capital of France is", max_new_tokens=3)["text"].strip()


# ---- SGLang features that interact: retraction --------------------------------------------------
@pytest.fixture(scope="module")
def retract_server():
    from .helpers import CHECKED_ENV, START_TIMEOUT

    env = {**CHECKED_ENV, "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "25"}
    srv = Server(
        [
            "--max-total-tokens",
            "40000",
            "--kv-policy",
            "lagkv",
            "--kv-budget",
            "128",
            "--kv-policy-config",
            '{"lag": 32}',
        ],
        env=env,
        timeout=START_TIMEOUT,
    )
    with srv:
        yield srv
        assert srv.alive(), srv.tail()


@pytest.mark.long
def test_retracted_compressed_requests_complete(retract_server: Server):
    prompts = [
        chat_ids([{"role": "user", "content": long_text(500, seed=60 + i) + "\nList three workers."}])
        for i in range(3)
    ]
    outs = run_parallel(
        lambda ids: retract_server.generate(input_ids=ids, max_new_tokens=60, ignore_eos=True), prompts
    )
    assert sum(o["meta_info"]["num_retractions"] for o in outs) >= 1
    for ids, out in zip(prompts, outs, strict=True):
        info = kvinfo(out)
        assert len(out["output_ids"]) == 60
        assert info["logical_tokens"] == len(ids) + 59
        assert info["kv_tokens"] < info["logical_tokens"] and not info["failed"]
        if out["meta_info"]["num_retractions"]:  # it came back through its own compressed history
            assert info["reused_evicted"] > 0, info
    retract_server.flush()
    state = retract_server.server_info()["internal_states"][0]["kvevict"]
    assert state["available_tokens"] == state["max_total_tokens"]


# ---- isolation: one request's config never reaches another's KV ------------------------------------
def test_compressed_history_is_isolated_per_config(kv_server: Server):
    """The cache-poisoning path: a client compresses a popular document with a tiny budget; requests with
    another config (or `none`) sharing that document must run on its full KV, never on the lossy copy."""
    doc = long_text(1500, seed=21)
    first = [{"role": "user", "content": doc + "\nSummarise."}]
    lossy = {"policy": "snapkv", "budget": 0.25}
    out = kv_server.generate(input_ids=chat_ids(first), max_new_tokens=8, kv=lossy)
    assert kvinfo(out)["evicted"] > 0
    follow = chat_ids(
        [*first, {"role": "assistant", "content": out["text"]}, {"role": "user", "content": "Why?"}]
    )
    same = kv_server.generate(input_ids=follow, max_new_tokens=4, kv=lossy)
    assert kvinfo(same)["reused_evicted"] > 0  # the producer's own config does reuse it
    for other in ({"policy": "none"}, {"policy": "snapkv", "budget": 0.5}, {"policy": "d2o", "budget": 0.25}):
        got = kv_server.generate(input_ids=follow, max_new_tokens=4, kv=other)
        info = kvinfo(got)
        assert info["reused_evicted"] == 0, (other, info)
        # ...and it still shares the document's full KV (the uncompressed copy stays in the tree)
        assert got["meta_info"]["cached_tokens"] >= 1500, (other, got["meta_info"])
