"""Soak: many mixed requests at a fixed concurrency on one live server; then the pool must be whole.

Each request picks a random policy (every registered one and `none`), budget, prompt length and decode
length; 30% continue an earlier finished conversation with the same config (so they match its compressed
history: counted when `reused_evicted` > 0); 10% are aborted, half by the client closing its stream after a
few chunks, half by SGLang's `/abort_request` on the running request. At the end: `/flush_cache`, the
pool's available tokens must equal its size, and the RSS growth of the server's processes is reported.
Errors (an HTTP error, a failed request, a missing or wrong answer) must be 0.

    HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/bench_soak.py --requests 1000 --concurrency 8 \
        --out results/soak

The SGLang leak checks (busy and idle) and KV page invariants run on the server throughout (as in tests).
`run_soak` is also the short soak of the test suite (`tests/test_reliability_e2e.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests
from transformers import AutoTokenizer

from sgl_kvevict.model import default_model_path
from sgl_kvevict.scenarios.text import log_text
from sgl_kvevict.serve.serverproc import Server

POLICIES = ["none", "streaming", "knorm", "h2o", "snapkv", "lagkv", "d2o", "graphkv", "criticalkv"]
BUDGETS: list[Any] = ["50%", "25%", 64, 128, 256, {"tokens": 96}, {"ratio": 0.3}]
CONFIGS: dict[str, list[dict]] = {
    "lagkv": [{}, {"lag": 32}],
    "graphkv": [{}, {"base": "lagkv", "base_config": {"lag": 32}}],
    "snapkv": [{}, {"interval": 8}],
}
CHECKED_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
}


@dataclass
class Soak:
    """What a soak did and saw; `errors` must stay empty."""

    requests: int = 0
    finished: int = 0
    continuations: int = 0
    matched_compressed: int = 0  # continuations that started on a compressed history
    aborted_disconnect: int = 0
    aborted_endpoint: int = 0
    compressed: int = 0  # finished requests that evicted something
    policies: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"{self.requests} requests, {self.finished} finished ({self.compressed} compressed), "
            f"{self.continuations} continuations ({self.matched_compressed} on a compressed history), "
            f"{self.aborted_disconnect} client disconnects, {self.aborted_endpoint} /abort_request, "
            f"{len(self.errors)} errors, {self.seconds:.0f} s"
        )


@dataclass
class Conv:
    kv: dict
    messages: list[dict]


class Client:
    """Builds requests and runs them against one server; thread-safe."""

    def __init__(
        self, url: str, seed: int, max_prompt: int = 1200, overrides: bool = True, scope: str | None = None
    ) -> None:
        self.url = url
        self.overrides = overrides  # False: no `custom_params` (a stock `--kv-policy none` server)
        self.scope = scope  # every compressing request's scope ("branch": the host tier demotes and recalls)
        self.rng = random.Random(seed)
        self.tok = AutoTokenizer.from_pretrained(default_model_path())
        self.max_prompt = max_prompt
        self.done: list[Conv] = []
        self.lock = threading.Lock()
        self.stats = Soak()

    def ids(self, messages: list[dict]) -> list[int]:
        return self.tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def plan(self, i: int) -> dict:
        """The i-th request: drawn under the lock (the generator is shared), run outside it."""
        with self.lock:
            r = self.rng
            roll = r.random()
            abort = "disconnect" if roll < 0.05 else "endpoint" if roll < 0.10 else None
            cont = None
            if self.done and r.random() < 0.30:
                cont = r.choice(self.done)
            if cont is not None:
                kv = cont.kv
                q = log_text(self.tok, r.randrange(20, 300), r.randrange(1 << 30)) + "\nAnd now?"
                messages = [*cont.messages, {"role": "user", "content": q}]
            else:
                policy = r.choice(POLICIES)
                kv = {"policy": policy}
                if policy != "none":
                    kv["budget"] = r.choice(BUDGETS)
                    kv["config"] = r.choice(CONFIGS.get(policy, [{}]))
                    if self.scope is not None:
                        kv["config"] = {**kv["config"], "scope": self.scope}
                text = log_text(self.tok, r.randrange(30, self.max_prompt), r.randrange(1 << 30))
                messages = [{"role": "user", "content": text + "\nWhat happened last?"}]
            return {
                "rid": f"soak-{i}-{r.randrange(1 << 30)}",
                "kv": kv,
                "messages": messages,
                "cont": cont is not None,
                "abort": abort,
                "n": r.randrange(4, 48),
                "ignore_eos": r.random() < 0.5,
            }

    def body(self, p: dict, stream: bool) -> dict:
        sampling: dict[str, Any] = {
            "max_new_tokens": p["n"] if p["abort"] is None else 400,
            "temperature": 0,
            "ignore_eos": p["ignore_eos"] or p["abort"] is not None,
        }
        if self.overrides:
            sampling["custom_params"] = {"kvevict": p["kv"]}
        return {
            "rid": p["rid"],
            "input_ids": self.ids(p["messages"]),
            "stream": stream,
            "sampling_params": sampling,
        }

    def run(self, p: dict) -> None:
        try:
            if p["abort"] is None:
                self._finish(p)
            else:
                self._abort(p)
        except Exception as e:  # every failure is counted, never raised out of the pool
            self._error(p, f"{type(e).__name__}: {str(e)[:200]}")

    def _error(self, p: dict, msg: str) -> None:
        with self.lock:
            self.stats.errors.append(f"{p['rid']} {p['kv']}: {msg}")

    def _finish(self, p: dict) -> None:
        r = requests.post(self.url + "/generate", json=self.body(p, False), timeout=1200)
        if r.status_code != 200:
            return self._error(p, f"HTTP {r.status_code}: {r.text[:200]}")
        out = r.json()
        meta = out["meta_info"]
        if meta["finish_reason"]["type"] not in ("length", "stop"):
            return self._error(p, f"finish_reason {meta['finish_reason']}")
        if not out["output_ids"] or (p["ignore_eos"] and len(out["output_ids"]) != p["n"]):
            return self._error(p, f"{len(out['output_ids'])} output tokens, asked {p['n']}")
        info = (meta.get("kvevict") or [None])[0]
        if self.overrides and p["kv"]["policy"] != "none":
            if info is None or info["policy"] != p["kv"]["policy"] or info["failed"]:
                return self._error(p, f"kvevict stats {info}")
        with self.lock:
            s = self.stats
            s.finished += 1
            s.policies[p["kv"]["policy"]] += 1
            s.continuations += p["cont"]
            if info is not None:
                s.matched_compressed += p["cont"] and info["reused_evicted"] > 0
                s.compressed += info["evicted"] > 0
            msgs = [*p["messages"], {"role": "assistant", "content": out["text"]}]
            if len(self.ids(msgs)) < 2 * self.max_prompt:  # conversations stay bounded
                self.done.append(Conv(p["kv"], msgs))

    def _abort(self, p: dict) -> None:
        """Stream, read a few chunks (the request is running and has compressed after its prefill),
        then close the connection or call /abort_request; the request must end as aborted."""
        with requests.post(self.url + "/generate", json=self.body(p, True), stream=True, timeout=1200) as r:
            if r.status_code != 200:
                return self._error(p, f"HTTP {r.status_code}: {r.text[:200]}")
            lines = r.iter_lines()
            chunks = 0
            for line in lines:
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    chunks += 1
                    if chunks >= 3:
                        break
            if chunks < 3:
                return self._error(p, f"stream ended after {chunks} chunks")
            if p["abort"] == "disconnect":
                r.close()
                with self.lock:
                    self.stats.aborted_disconnect += 1
                return None
            a = requests.post(self.url + "/abort_request", json={"rid": p["rid"]}, timeout=60)
            if a.status_code != 200:
                return self._error(p, f"/abort_request HTTP {a.status_code}")
            last = None
            for line in lines:
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    last = json.loads(line[5:])
            reason = (last or {}).get("meta_info", {}).get("finish_reason") or {}
            if reason.get("type") != "abort":
                return self._error(p, f"after /abort_request, finish_reason {reason}")
            with self.lock:
                self.stats.aborted_endpoint += 1
        return None


def run_soak(
    url: str,
    n: int,
    concurrency: int = 8,
    seed: int = 0,
    progress_every: int = 0,
    max_prompt: int = 1200,
    max_seconds: float | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> Soak:
    """`n` requests, `concurrency` in flight; conversations to continue are drawn from finished ones.
    With `max_seconds`, no request is sent after that time (the ones in flight finish)."""
    c = Client(url, seed, max_prompt)
    t0 = time.time()
    drive(c, 0, n, concurrency, progress_every, max_seconds, on_progress)
    c.stats.seconds = time.time() - t0
    return c.stats


def drive(
    c: Client,
    start: int,
    stop: int,
    concurrency: int = 8,
    progress_every: int = 0,
    max_seconds: float | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> int:
    """Requests `start`..`stop - 1` of client `c`'s plan, `concurrency` in flight, all finished on return
    (a soak can be run in blocks, e.g. interleaved between servers); returns the next request index."""
    t0 = time.time()
    i = start
    with ThreadPoolExecutor(concurrency) as ex:
        running: set[Future] = set()
        for i in range(start, stop):
            if max_seconds is not None and time.time() - t0 > max_seconds:
                print(f"[soak] time limit ({max_seconds:.0f} s) reached after {i} requests", file=sys.stderr)
                break
            if len(running) >= concurrency:
                _, running = wait(running, return_when=FIRST_COMPLETED)
            running.add(ex.submit(c.run, c.plan(i)))
            c.stats.requests = i + 1
            if progress_every and (i + 1) % progress_every == 0:
                print(f"[soak] {time.time() - t0:6.0f} s  {c.stats.line()}", file=sys.stderr, flush=True)
                if on_progress is not None:
                    on_progress(i + 1)
        else:
            i = stop
        wait(running)
    return i


def pool(url: str) -> dict:
    return requests.get(url + "/server_info", timeout=60).json()["internal_states"][0]["kvevict"]


def flush_until_whole(url: str, timeout: float = 120) -> dict:
    """Flush (it succeeds only once nothing runs: aborted requests may still be leaving) until the pool
    is whole or the timeout passes; returns the last pool state."""
    t0 = time.time()
    state = pool(url)
    while time.time() - t0 < timeout:
        requests.post(url + "/flush_cache", timeout=60)
        state = pool(url)
        if state["available_tokens"] == state["max_total_tokens"]:
            break
        time.sleep(1.0)
    return state


def rss_by_process(pid: int) -> dict[str, float]:
    """Resident memory of the server and each child process, MiB, by a short name (where growth is)."""
    proc = psutil.Process(pid)
    out: dict[str, float] = {}
    for p in [proc, *proc.children(recursive=True)]:
        try:
            name = "http" if p.pid == pid else " ".join(p.cmdline()[:1]).rsplit("/", 1)[-1][:24] or p.name()
            name = p.name() if name.startswith("python") else name
            key, i = name, 2
            while key in out:
                key, i = f"{name}-{i}", i + 1
            out[key] = round(p.memory_info().rss / (1 << 20), 1)
        except psutil.NoSuchProcess:
            pass
    return out


def rss_mib(pid: int) -> float:
    """Resident memory of the server process and all its children (scheduler, detokenizer), MiB."""
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / (1 << 20)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server on the way out
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=100, help="requests before the RSS baseline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-total-tokens", type=int, default=40000)
    ap.add_argument("--max-prompt", type=int, default=1200, help="longest first-turn prompt, tokens")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop sending after this long")
    ap.add_argument("--out", type=Path, default=Path("results/soak"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    srv = Server(
        ["--max-total-tokens", str(args.max_total_tokens), "--kv-policy", "d2o", "--kv-budget", "256"],
        env={**CHECKED_ENV, "KVEVICT_COUNT_OBJECTS": "1"},
        log_path=args.out / "server.log",
    )
    with srv:
        rss0 = rss_mib(srv.proc.pid)
        warm = run_soak(srv.url, args.warmup, args.concurrency, args.seed + 1, max_prompt=args.max_prompt)
        flush_until_whole(srv.url)
        rss1 = rss_mib(srv.proc.pid)
        samples: list[dict] = []

        def sample(done: int) -> None:
            """RSS per process and our live per-request objects, every `progress_every` requests: growth
            that levels off is the allocators warming up, growth linear in requests is a leak."""
            info = srv.server_info()["internal_states"][0].get("kvevict", {})
            row = {
                "requests": done,
                "rss_mib": round(rss_mib(srv.proc.pid), 1),
                "by_process": rss_by_process(srv.proc.pid),
                "live_request_states": info.get("live_request_states"),
                "capture_rings": info.get("capture_rings"),
                "python_objects": info.get("python_objects"),
            }
            samples.append(row)
            print(f"[soak] {json.dumps(row)}", file=sys.stderr, flush=True)

        stats = run_soak(
            srv.url,
            args.requests,
            args.concurrency,
            args.seed,
            progress_every=25,
            max_prompt=args.max_prompt,
            max_seconds=args.max_seconds,
            on_progress=sample,
        )
        rss_busy = rss_mib(srv.proc.pid)  # before the flush (and its malloc_trim)
        state = flush_until_whole(srv.url)
        rss2 = rss_mib(srv.proc.pid)
        idle = srv.server_info()["internal_states"][0].get("kvevict", {})
        procs_end = rss_by_process(srv.proc.pid)
        alive = srv.alive()
        log = srv.log_path.read_text(errors="replace")
    result = {
        "requests": stats.requests,
        "max_prompt": args.max_prompt,
        "max_seconds": args.max_seconds,
        "concurrency": args.concurrency,
        "finished": stats.finished,
        "compressed": stats.compressed,
        "continuations": stats.continuations,
        "matched_compressed": stats.matched_compressed,
        "aborted_disconnect": stats.aborted_disconnect,
        "aborted_endpoint": stats.aborted_endpoint,
        "per_policy_finished": dict(stats.policies),
        "errors": stats.errors,
        "warmup_errors": warm.errors,
        "seconds": round(stats.seconds, 1),
        "pool_whole_after_flush": state["available_tokens"] == state["max_total_tokens"],
        "pool": state,
        "rss_mib_start": round(rss0, 1),
        "rss_mib_after_warmup": round(rss1, 1),
        "rss_mib_end_before_flush": round(rss_busy, 1),
        "rss_mib_end": round(rss2, 1),
        "heap_mib_trimmed": idle.get("heap_mib_trimmed"),
        "rss_growth_mib_after_warmup": round(rss2 - rss1, 1),
        "rss_by_process_end": procs_end,
        "idle_live_request_states": idle.get("live_request_states"),
        "idle_capture_rings": idle.get("capture_rings"),
        "samples": samples,
        "tracebacks_in_log": log.count("Traceback"),
        "server_alive": alive,
    }
    (args.out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(stats.line())
    print(json.dumps({k: v for k, v in result.items() if k not in ("errors", "pool")}, indent=2))
    for e in stats.errors[:20]:
        print("ERROR", e)
    ok = alive and not stats.errors and not warm.errors and result["pool_whole_after_flush"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
