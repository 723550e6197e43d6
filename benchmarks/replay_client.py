"""Driving a live SGLang server for the replay benchmark: chat rendering to token ids, one timed turn
(streamed, for TTFT), teacher-forced scoring, a load poller, and SGLang's own bench_serving.

Prompts are sent as token ids built incrementally (previous prompt + the model's own output ids + the
new messages), so every turn extends the last one token for token and prefix reuse is exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

SENTINEL = "\x00SENTINEL\x00"


class ChatIds:
    """Token ids of chat pieces, derived from the model's own chat template (chatml for SmolLM2)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        t = tokenizer.apply_chat_template
        two = t(
            [{"role": "system", "content": SENTINEL}, {"role": "user", "content": SENTINEL}], tokenize=False
        )
        sys_header, _, self.footer = two.split(SENTINEL)
        self._header = sys_header
        one = t([{"role": "user", "content": SENTINEL}], tokenize=False)
        gen = t([{"role": "user", "content": SENTINEL}], tokenize=False, add_generation_prompt=True)
        self.gen_prompt = self.encode(gen[len(one) :])
        self.default_system = one.partition(SENTINEL)[0][
            : -len(self.header("user"))
        ]  # template's implicit system block
        self.end_ids = self.encode(self.footer)

    def header(self, role: str) -> str:
        return self._header.replace("system", role, 1)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def message(self, role: str, content: str) -> list[int]:
        return self.encode(f"{self.header(role)}{content}{self.footer}")

    def start(self, system: str | None) -> list[int]:
        return self.message("system", system) if system is not None else self.encode(self.default_system)

    def after_answer(self, output_ids: list[int]) -> list[int]:
        """The answer's ids, closed with the end-of-message tokens unless the model emitted them."""
        out = list(output_ids)
        n = len(self.end_ids)
        if n and out[-1:] == self.end_ids[:1]:
            return out + self.end_ids[1:]
        return out + self.end_ids


@dataclass
class Call:
    """One finished /generate call, timed on the client."""

    text: str
    output_ids: list[int]
    meta: dict[str, Any]
    ttft: float | None
    e2e: float
    start: float
    end: float
    error: str | None = None

    @property
    def decode_tps(self) -> float | None:
        n = int(self.meta.get("completion_tokens", 0))
        if self.ttft is None or n < 2 or self.e2e <= self.ttft:
            return None
        return (n - 1) / (self.e2e - self.ttft)


ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router: the session key its `manual` policy sticks to


def generate(
    url: str,
    ids: list[int],
    max_new_tokens: int,
    kv: dict | None,
    stream: bool = True,
    timeout: float = 3600,
    routing_key: str | None = None,
) -> Call:
    """One greedy turn. Streamed: TTFT is the arrival of the first token. `routing_key` goes in
    sglang-router's session header (ignored by a plain server)."""
    sp: dict[str, Any] = {"temperature": 0, "max_new_tokens": max_new_tokens}
    if kv:
        sp["custom_params"] = {"kvevict": kv}
    body = {"input_ids": ids, "sampling_params": sp, "stream": stream}
    t0 = time.time()
    ttft = None
    last: dict[str, Any] = {}
    try:
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        with requests.post(
            url + "/generate", json=body, stream=stream, timeout=timeout, headers=headers
        ) as r:
            r.raise_for_status()
            if stream:
                for line in r.iter_lines():
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if ttft is None and chunk.get("output_ids"):
                        ttft = time.time() - t0
                    last = chunk
            else:
                last = r.json()
    except (requests.RequestException, ValueError) as e:
        t1 = time.time()
        return Call("", [], {}, None, t1 - t0, t0, t1, error=f"{type(e).__name__}: {e}")
    t1 = time.time()
    meta = dict(last.get("meta_info", {}))
    if "kvevict_stream" in meta:  # streamed: the stats ride in the last entry of a per-token list
        meta["kvevict"] = [x for x in meta.pop("kvevict_stream") if x][-1:]
    return Call(
        last.get("text") or "",
        list(last.get("output_ids") or []),
        meta,
        ttft,
        t1 - t0,
        t0,
        t1,
    )


def chat(
    url: str, messages: list[dict[str, str]], max_tokens: int, kv: dict | None, timeout: float = 3600
) -> Call:
    """One greedy turn through the OpenAI chat API (not streamed: no TTFT); SGLang renders the template,
    and `return_meta_info` brings back the same `meta_info` a `/generate` call has."""
    body: dict[str, Any] = {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_meta_info": True,
    }
    if kv:
        body["custom_params"] = {"kvevict": kv}
    t0 = time.time()
    try:
        r = requests.post(url + "/v1/chat/completions", json=body, timeout=timeout)
        r.raise_for_status()
        j = r.json()
    except (requests.RequestException, ValueError) as e:
        t1 = time.time()
        return Call("", [], {}, None, t1 - t0, t0, t1, error=f"{type(e).__name__}: {e}")
    t1 = time.time()
    choice = j["choices"][0]
    meta = dict(choice.get("meta_info") or {})
    meta.setdefault("prompt_tokens", j["usage"]["prompt_tokens"])
    meta.setdefault("completion_tokens", j["usage"]["completion_tokens"])
    return Call(choice["message"]["content"] or "", [], meta, None, t1 - t0, t0, t1)


def loglik(
    url: str, prompt: list[int], answer: list[int], kv: dict | None, timeout: float = 3600
) -> dict[str, float] | None:
    """Teacher-forced log-likelihood of `answer` after `prompt` (prefix matched as the policy stored it)."""
    if not answer:
        return None
    sp: dict[str, Any] = {"temperature": 0, "max_new_tokens": 1}
    if kv:
        sp["custom_params"] = {"kvevict": kv}
    body = {
        "input_ids": prompt + answer,
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": len(prompt),
    }
    try:
        r = requests.post(url + "/generate", json=body, timeout=timeout)
        r.raise_for_status()
        lps = [x[0] for x in r.json()["meta_info"].get("input_token_logprobs", []) if x and x[0] is not None]
    except (requests.RequestException, KeyError, ValueError):
        return None
    if not lps:
        return None
    return {"sum": float(sum(lps)), "mean": float(sum(lps) / len(lps)), "tokens": len(lps)}


@dataclass
class LoadPoller:
    """Samples GET /v1/loads: running requests (sessions held at once) and KV tokens in use."""

    url: str
    interval: float = 1.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> LoadPoller:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                load = requests.get(self.url + "/v1/loads?include=core", timeout=30).json()["loads"][0]
                self.samples.append(
                    {
                        k: load.get(k)
                        for k in (
                            "timestamp",
                            "num_running_reqs",
                            "num_waiting_reqs",
                            "num_used_tokens",
                            "token_usage",
                            "max_total_num_tokens",
                        )
                    }
                )
            except (requests.RequestException, KeyError, IndexError, ValueError):
                pass
            self._stop.wait(self.interval)

    def summary(self) -> dict[str, Any]:
        def peak(k: str) -> float:
            return max((s[k] or 0 for s in self.samples), default=0)

        return {
            "samples": len(self.samples),
            "peak_running_reqs": peak("num_running_reqs"),
            "peak_waiting_reqs": peak("num_waiting_reqs"),
            "peak_used_tokens": peak("num_used_tokens"),
            "peak_token_usage": peak("token_usage"),
        }


def server_totals(url: str) -> dict[str, Any]:
    """The plugin's server-wide counters (empty on a server started with --kv-policy none)."""
    try:
        states = requests.get(url + "/server_info", timeout=60).json().get("internal_states") or [{}]
        return dict(states[0].get("kvevict") or {})
    except (requests.RequestException, ValueError):
        return {}


def cluster_totals(urls: list[str]) -> dict[str, Any]:
    """The plugin's counters summed over several workers (behind a router, which has no /server_info)."""
    out: dict[str, Any] = {}
    for u in urls:
        for k, v in server_totals(u).items():
            if isinstance(v, int | float) and k != "started":
                out[k] = out.get(k, 0) + v
    return out


def flush(url: str) -> None:
    for _ in range(30):
        try:
            if requests.post(url + "/flush_cache", timeout=60).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)


BENCH_KEYS = [
    "completed",
    "duration",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_itl_ms",
    "median_e2e_latency_ms",
]


def bench_serving(
    url: str, model: str, out: Path, args: list[str], kv: dict | None, seed: int, timeout: float = 7200
) -> dict[str, Any]:
    """`python -m sglang.benchmark.serving` (generated-shared-prefix, multi-turn) against the server."""
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        "--backend",
        "sglang-oai-chat",
        "--base-url",
        url,
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "generated-shared-prefix",
        "--seed",
        str(seed),
        "--output-file",
        str(out),
        *args,
    ]
    if kv:
        cmd += ["--extra-request-body", json.dumps({"custom_params": {"kvevict": kv}})]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env={"HF_HUB_OFFLINE": "1", **_env()}
        ).returncode
    if rc != 0 or not out.exists():
        return {"error": f"bench_serving exited {rc}; see {log}", "command": " ".join(cmd)}
    last = json.loads(out.read_text().strip().splitlines()[-1])
    return {"command": " ".join(cmd), **{k: last.get(k) for k in BENCH_KEYS}}


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
