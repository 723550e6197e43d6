"""Deterministic test inputs and small checks shared by the end-to-end tests."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import requests
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sgl_kvevict.model import default_model_path
from sgl_kvevict.scenarios.text import log_text
from sgl_kvevict.serve.serverproc import Server

CHECKED_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
    "KVEVICT_DEBUG": "1",
    "KVEVICT_LOAD": "sgl_kvevict.tools.testing:load",  # the test-only policies (tools/testing.py)
}
POOL = ["--max-total-tokens", "40000"]
# `conftest.recall_server`'s host tier: snapkv's token budget, the entries per layer and KV head a turn
# may recall, the host columns
RECALL_BUDGET, RECALL_TOKENS, RECALL_HOST = 64, 64, 1500
# One start limit for every test server. Readiness is polled (a crash surfaces at once): the long limit
# only lets a loaded machine, where a start has taken over 300 s, finish starting.
START_TIMEOUT = 1200


def _server(args: list[str]) -> Iterator[Server]:
    srv = Server(args, env=CHECKED_ENV, timeout=START_TIMEOUT)
    srv.start()
    try:
        yield srv
    finally:
        alive = srv.alive()
        tail = srv.tail()
        srv.stop()
        assert alive, f"server died during the tests; log tail:\n{tail}"


@functools.cache
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_path())


def long_text(n_tokens: int, seed: int = 0) -> str:
    """A log-like text of `n_tokens` tokens (deterministic)."""
    return log_text(tokenizer(), n_tokens, seed)


def chat_ids(messages: list[dict]) -> list[int]:
    return tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def not_collapsed(output_ids: list[int]) -> bool:
    """Fluent enough: no long run of one token and a reasonable number of distinct tokens."""
    if len(output_ids) < 8:
        return True
    longest = run = 1
    for a, b in zip(output_ids, output_ids[1:], strict=False):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    return longest < 8 and len(set(output_ids)) >= min(10, len(output_ids) // 4)


# ---- server speed and a watchdog: timeouts that follow the machine, and a dump when a request is late ----
@dataclass(frozen=True)
class Speed:
    """A lone request's cost on this server now: seconds per prompt token and per decode step. A loaded
    machine (other jobs on the cores) is slower by a factor the suite cannot know in advance."""

    prefill_s: float
    decode_s: float

    def expected(self, prefill_tokens: int, decode_steps: int) -> float:
        """Seconds a workload should take: every prompt token prefilled, and `decode_steps` scheduler
        steps (a running batch advances all its requests by one token per step: count the steps of
        the longest chain of admissions, not tokens). A batch's step costs more than a lone one's:
        `timeout` leaves room for that."""
        return prefill_tokens * self.prefill_s + decode_steps * self.decode_s

    def timeout(self, prefill_tokens: int, decode_steps: int) -> float:
        """An HTTP timeout for that workload: eight times the estimate, never under 600 s."""
        return max(600.0, 8 * self.expected(prefill_tokens, decode_steps))


def speed(srv: Server) -> Speed:
    """Measured now (a machine's load changes within minutes, so each test measures at its start): a
    400-token prefill, then 32 decode steps on the cached prompt, then a flush (the tree left empty)."""
    ids = chat_ids([{"role": "user", "content": long_text(400, seed=4242)}])
    kv = {"policy": "none"}
    t0 = time.perf_counter()
    srv.generate(input_ids=ids, max_new_tokens=1, kv=kv)
    t1 = time.perf_counter()
    srv.generate(input_ids=ids, max_new_tokens=33, ignore_eos=True, kv=kv)
    t2 = time.perf_counter()
    requests.post(srv.url + "/flush_cache", timeout=60)
    measured = Speed(prefill_s=(t1 - t0) / len(ids), decode_s=(t2 - t1) / 32)
    print(f"[speed] {srv.url}: {measured}", file=sys.stderr, flush=True)
    return measured


def scheduler_report(srv: Server, lines: int = 6) -> str:
    """What the scheduler holds now (running batch, waiting queue, each request's progress and
    compression state: `/server_info` under KVEVICT_DEBUG=1) and its last batch log lines, which show
    whether steps still run. A scheduler that does not answer is inside one step (or stuck there)."""
    try:
        info = requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]["kvevict"]
        state = json.dumps({k: info.get(k) for k in ("queues", "available_tokens", "max_total_tokens")})
    except (requests.RequestException, KeyError, ValueError) as e:
        state = f"/server_info did not answer: {e!r}"
    try:
        log = srv.log_path.read_text(errors="replace").splitlines()
    except OSError:
        log = []
    steps = [line[:260] for line in log if "batch," in line][-lines:]
    return state + "\nlast scheduler steps:\n" + "\n".join(steps)


@contextlib.contextmanager
def watchdog(srv: Server, label: str, expected_s: float) -> Iterator[None]:
    """Prints `scheduler_report` to stderr when the block runs past `expected_s`, then again every
    `expected_s / 2` (at least 30 s) until it ends: a late request is then diagnosable (still running,
    waiting, retracted, a compression pending) whether it finishes late or times out."""
    done = threading.Event()
    t0 = time.monotonic()

    def watch() -> None:
        wait = expected_s
        while not done.wait(wait):
            late = time.monotonic() - t0
            print(
                f"[watchdog] {label}: {late:.0f} s, expected {expected_s:.0f} s\n{scheduler_report(srv)}",
                file=sys.stderr,
                flush=True,
            )
            wait = max(30.0, expected_s / 2)

    thread = threading.Thread(target=watch, daemon=True, name=f"watchdog-{label}")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


def host_state(srv: Server) -> dict:
    """The server's host-tier totals (`/server_info`, `internal_states[0]["kvevict"]["host"]`)."""
    return srv.server_info()["internal_states"][0]["kvevict"]["host"]


def scrape(srv: Server) -> dict[str, float]:
    """Every `sglang:kvevict_*` sample on `/metrics`, summed over label sets (histograms by sample name:
    `_bucket` summed over `le` is not meaningful, so only `_count` and `_sum` are kept for them)."""
    text = requests.get(srv.url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for m in re.finditer(r"^(sglang:kvevict_\w+)\{([^}]*)\} (\S+)$", text, re.M):
        name, value = m.group(1), float(m.group(3))
        if name.endswith("_bucket"):
            continue
        out[name] = out.get(name, 0.0) + value
    return out
