"""Scale-out: compressing workers behind sglang-router, Prometheus metrics, --dp-size, the offline Engine.

All real processes on loopback: SGLang workers with the plugin, the Rust router from `sglang-router`.
Prompts are small (this CPU is shared): the point is where turns land and what is reused, not speed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_kvevict.cluster import Cluster
from sgl_kvevict.config import ENV_VAR
from sgl_kvevict.serve import plugin
from sgl_kvevict.serve.serverproc import Server

from .helpers import CHECKED_ENV, START_TIMEOUT, long_text, tokenizer

SESSIONS, TURNS = 6, 4
WORKER_ARGS = [
    "--max-total-tokens",
    "20000",
    "--kv-policy",
    "d2o",
    "--kv-budget",
    "0.5",
    "--enable-metrics",
]


def _prompt(history: list[dict]) -> str:
    return tokenizer().apply_chat_template(history, tokenize=False, add_generation_prompt=True)


def _session(url: str, s: int) -> list[dict]:
    """One conversation of TURNS turns through the router; each turn re-sends the whole history as text
    (the router's cache-aware policy routes on the request text)."""
    history = [{"role": "system", "content": f"You are operations assistant number {s}."}]
    turns = []
    for t in range(TURNS):
        history.append(
            {"role": "user", "content": long_text(120, seed=100 * s + t) + f"\nQ{t}: most common status?"}
        )
        body = {"text": _prompt(history), "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        r = requests.post(url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        j = r.json()
        meta = j["meta_info"]
        turns.append({"prompt": meta["prompt_tokens"], "completion": meta["completion_tokens"], **meta})
        history.append({"role": "assistant", "content": j["text"]})
    return turns


def _state(url: str) -> dict:
    return requests.get(url + "/server_info", timeout=60).json()["internal_states"][0]["kvevict"]


def _metric(text: str, name: str) -> float:
    """Sum of a metric's samples (one per label set) in Prometheus text format."""
    vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)]
    assert vals, f"{name} not on /metrics"
    return sum(vals)


@pytest.mark.server
@pytest.mark.long
def test_sessions_stay_on_their_worker_behind_the_router_and_metrics_are_exported(tmp_path):
    with Cluster(2, WORKER_ARGS, env=CHECKED_ENV, log_dir=tmp_path) as c:
        with ThreadPoolExecutor(3) as ex:
            results = list(ex.map(lambda s: _session(c.url, s), range(SESSIONS)))
        for s, turns in enumerate(results):
            for t in range(1, TURNS):
                prev, cur = turns[t - 1], turns[t]
                info = cur["kvevict"][0]
                # The turn landed where its history is: the compressed history was matched.
                assert info["reused_evicted"] > 0, (s, t, info)
                assert cur["cached_tokens"] >= prev["prompt"], (s, t, cur["cached_tokens"], prev["prompt"])
        states = [_state(w.url) for w in c.workers]
        served = [st["requests_compressed"] for st in states]
        assert all(n > 0 for n in served), served  # both workers served sessions
        assert SESSIONS * (TURNS - 1) <= sum(served) <= SESSIONS * TURNS, served
        for w, st in zip(c.workers, states, strict=True):
            text = requests.get(w.url + "/metrics", timeout=30).text
            assert "sglang:num_running_reqs" in text  # SGLang's own metrics, same endpoint
            assert _metric(text, "sglang:kvevict_compressions_total") == st["compressions"] > 0
            assert _metric(text, "sglang:kvevict_slots_freed_total") == st["slots_freed"] > 0
            assert _metric(text, "sglang:kvevict_tokens_evicted_total") == st["tokens_evicted"] > 0
            assert _metric(text, "sglang:kvevict_requests_compressed_total") == st["requests_compressed"]
            assert _metric(text, "sglang:kvevict_policy_failures_total") == 0
            assert _metric(text, "sglang:kvevict_compression_seconds_total") > 0
            assert _metric(text, "sglang:kvevict_tokens_merged_total") == st["tokens_merged"]
            held = _metric(text, "sglang:kvevict_compressed_kv_tokens")
            assert held == st["compressed_kv_tokens"] > 0
            assert st["compressed_kv_tokens"] <= st["evictable_tokens"] + st["protected_tokens"]
        # No leaked KV slot on any worker once its cache is flushed.
        for w in c.workers:
            assert requests.post(w.url + "/flush_cache", timeout=60).status_code == 200
            st = _state(w.url)
            assert st["available_tokens"] == st["max_total_tokens"], st
            assert st["compressed_kv_tokens"] == 0
        assert c.alive()


ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import sglang as sgl
    from sgl_kvevict.launch import has_cuda
    from sgl_kvevict.model import default_model_path

    cpu = {} if has_cuda() else dict(device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                                     disable_cuda_graph=True, max_total_tokens=8000)
    llm = sgl.Engine(model_path=str(default_model_path()), kv_policy="d2o", kv_budget=0.5, **cpu)
    try:
        prompt = sys.stdin.read()
        outs = llm.generate([prompt, prompt + " Again."], {"temperature": 0, "max_new_tokens": 12})
        print("RESULT " + json.dumps([o["meta_info"] for o in outs]))
    finally:
        llm.shutdown()
    """
)


@pytest.mark.server
@pytest.mark.long
def test_offline_engine_takes_the_policy_as_keyword_arguments():
    env = {
        **CHECKED_ENV,
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "KVEVICT_BF16_LINEAR": "fp64",
    }

    res = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT],
        input=long_text(600, seed=7),
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, **env},
    )
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and line, res.stderr[-3000:]
    metas = json.loads(line[0][len("RESULT ") :])
    first, second = (m["kvevict"][0] for m in metas)
    assert first["policy"] == "d2o" and first["evicted"] > 0, first
    assert first["kv_tokens"] < first["logical_tokens"], first
    # The second prompt extends the first: batched with it, it compresses its own copy; admitted after
    # the first's prompt was checkpointed, it shares that prompt through the tree instead.
    assert second["policy"] == "d2o", second
    assert second["evicted"] > 0 or second["prefix_kv_tokens"] >= 500, second


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"kv_policy": "bogus"}, ["bogus", "lagkv", "d2o"]),
        ({"kv_policy": "lagkv", "kv_budget": 1.5}, ["budget"]),
        ({"kv_policy": "lagkv", "kv_budget": "abc"}, ["kv_budget"]),
        ({"kv_policy": "lagkv", "kv_policy_config": {"colour": 1}}, ["colour"]),
        ({"kv_policy": "lagkv", "page_size": 16}, ["--page-size 1"]),
    ],
)
def test_offline_engine_rejects_bad_keyword_arguments(kwargs, needles, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "")  # restored (removed) afterwards
    with pytest.raises(ValueError) as e:
        plugin.server_args_init(object(), model_path="unused", **kwargs)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_engine_keywords_become_server_args(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "")  # restored (removed) afterwards
    args, kwargs = plugin.server_args_init(object(), model_path="m", kv_policy="d2o", kv_budget=0.5)
    assert kwargs["model_path"] == "m" and kwargs["radix_cache_backend"] == plugin.BACKEND_NAME
    assert not set(kwargs) & set(plugin.ENGINE_KEYS)
    assert json.loads(os.environ[ENV_VAR])["policy"] == "d2o"


def test_engine_takes_every_setting(monkeypatch):
    """`sgl.Engine(kv_...=...)` takes one keyword per launcher flag, each checked and published as the
    flag would be (a string is parsed as on the command line; a number or a dict is the value)."""
    from sgl_kvevict.config import FLAGS, SETTINGS_ENV_VAR, KvConfig, ServerSettings

    monkeypatch.setenv(ENV_VAR, "")  # restored (removed) afterwards
    monkeypatch.setenv(SETTINGS_ENV_VAR, "")
    assert plugin.ENGINE_KEYS == tuple(f.dest for f in FLAGS)
    every = {
        "kv_policy": "snapkv",
        "kv_budget": "50%",
        "kv_scope": "branch",
        "kv_policy_config": {"window": 16},
        "kv_overrides": {"policies": ["snapkv", "lagkv"], "min_budget": "64", "max_window": 48},
        "kv_compress_step_tokens": 2048,
        "kv_recall_tokens": 8,
        "kv_host_tokens": "4096",
        "kv_recall_config": {"page": 4, "every": 2},
    }
    # --kv-host-gib sizes the same tier as --kv-host-tokens, never beside it: checked on its own below
    assert set(every) | {"kv_host_gib"} == set(plugin.ENGINE_KEYS)
    args, kwargs = plugin.server_args_init(object(), model_path="m", max_running_requests=16, **every)
    assert not set(kwargs) & set(plugin.ENGINE_KEYS) and kwargs["max_running_requests"] == 16
    cfg = KvConfig.model_validate_json(os.environ[ENV_VAR])
    assert (cfg.policy, cfg.budget, cfg.config) == ("snapkv", 0.5, {"window": 16, "scope": "branch"})
    got = ServerSettings.model_validate_json(os.environ[SETTINGS_ENV_VAR])
    assert got.overrides.policies == ["lagkv", "snapkv"] and got.overrides.min_budget_tokens == 64
    assert (got.step_tokens, got.recall_tokens, got.host_tokens) == (2048, 8, 4096)
    assert (got.recall.page, got.recall.every) == (4, 2)
    assert (got.capture_window, got.capture_slots) == (48, 16)
    in_gib = {k: v for k, v in every.items() if k != "kv_host_tokens"}
    plugin.server_args_init(object(), model_path="m", **in_gib, kv_host_gib="0.5")
    assert ServerSettings.model_validate_json(os.environ[SETTINGS_ENV_VAR]).host_gib == 0.5
    with pytest.raises(ValueError, match="give one"):
        plugin.server_args_init(object(), model_path="m", **every, kv_host_gib=0.5)
    for key, bad, needle in (
        ("kv_scope", "tree", "valid choices"),
        ("kv_recall_tokens", 5000, "[0, 4096]"),
        ("kv_recall_tokens", True, "integer"),
        ("kv_overrides", {"policies": ["nope"]}, "'nope'"),
        ("kv_recall_config", {"page": 0}, "[1, 256]"),
        ("kv_compress_step_tokens", "0", "out of range"),
    ):
        with pytest.raises(ValueError, match=re.escape(needle)) as e:
            plugin.server_args_init(object(), model_path="m", **{**every, key: bad})
        assert str(e.value).startswith(key), str(e.value)


def test_engine_builds_server_args_from_our_keywords(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "")  # restored (removed) afterwards
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import ServerArgs

    plugin._patch_engine()
    sa = Engine.server_args_class(model_path="m", kv_policy="lagkv", kv_budget="256", device="cpu")
    assert type(sa) is ServerArgs and sa.radix_cache_backend == plugin.BACKEND_NAME
    assert json.loads(os.environ[ENV_VAR])["budget"] == 256
    with pytest.raises(ValueError, match="valid choices"):
        Engine.server_args_class(model_path="m", kv_policy="nope")


@pytest.mark.server
@pytest.mark.long
def test_data_parallel_ranks_each_compress_and_report():
    """`--dp-size 2` under a policy: each rank runs its own compressing tree (on CPU, launch binds one
    core range per rank: SGLANG_CPU_OMP_THREADS_BIND)."""
    args = ["--kv-policy", "d2o", "--kv-budget", "0.5", "--dp-size", "2", "--max-total-tokens", "8000"]
    with Server([*args, "--enable-metrics"], env=CHECKED_ENV, timeout=START_TIMEOUT) as s:
        with ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(lambda i: s.generate(long_text(300, seed=i), max_new_tokens=8), range(4)))
        for o in outs:
            info = o["meta_info"]["kvevict"][0]
            assert info["evicted"] > 0 and info["kv_tokens"] < info["logical_tokens"], info
        states = [st["kvevict"] for st in s.server_info()["internal_states"]]
        assert len(states) == 2 and all(st["compressions"] > 0 for st in states), states
        text = requests.get(s.url + "/metrics", timeout=30).text
        for rank, st in enumerate(states):
            line = re.search(
                rf'^sglang:kvevict_compressions_total\{{dp_rank="{rank}",[^}}]*\}} (\S+)$', text, re.M
            )
            assert line and float(line.group(1)) == st["compressions"], (rank, st)
        s.flush()
        for st in (st["kvevict"] for st in s.server_info()["internal_states"]):
            assert st["available_tokens"] == st["max_total_tokens"], st
        assert s.alive()
