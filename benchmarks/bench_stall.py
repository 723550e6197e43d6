"""Stalls: inter-token latency of small streaming requests while heavy requests compress for the first time.

Compression runs inside the scheduler step, so while one request compresses every other request of the
batch waits. Small streams (`none`, short prompts) decode while, in turn:

- `alone`: nothing else runs;
- `heavy-none`: H heavy requests (long prompts, `none`) arrive at once: their prefill alone;
- `heavy-<policy>`: the same heavy requests under a heavy policy (criticalkv): prefill + first compression.

The stall compression adds is `heavy-<policy>` minus `heavy-none` (same prompts' lengths, same prefill),
and, measured by the server itself, `step_seconds_max` from `/server_info`: the longest one scheduler
step has spent compressing since the server started (`step max s`; only the heavy requests compress).
Each server configuration runs every scenario `--repeats` times; one server per configuration, given as
`NAME=FLAGS` (e.g. `cap=--kv-compress-step-tokens 2048`), the configurations one after the other.

    HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/bench_stall.py --heavy 3 --heavy-tokens 2000 \
        --config "nocap=" --config "cap=--kv-compress-step-tokens 2048" --out results/stall-prefill-and-compression

The heavy prefill stalls the small streams too (SGLang runs a chunked prefill's chunks back to back), and
on a CPU it dwarfs a compression. `--warm` takes it out: the heavy prompts are cached first (`none`, one
token), so the measured heavy requests prefill almost nothing and, in branch scope, their first
compression covers the whole cached prompt; the largest gap is then the compression's. With
`--kv-compress-step-tokens` below the heavy prompts, that compression is planned over several steps while
its request decodes: give the heavy requests enough new tokens (`--heavy-new`) for the plan to commit
before they finish:

    HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/bench_stall.py --warm --heavy 1 --heavy-tokens 4000 \
        --heavy-new 40 --config "whole=" --config "split=--kv-compress-step-tokens 256" \
        --out results/stall-split-compression

Numbers depend on the machine's load: compare configurations measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import requests
from transformers import AutoTokenizer

from sgl_kvevict.model import default_model_path
from sgl_kvevict.scenarios.text import log_text
from sgl_kvevict.serve.serverproc import Server


def stream_gaps(url: str, ids: list[int], n: int, started: threading.Event, out: list[float]) -> None:
    """Stream `n` tokens; append the gaps between consecutive tokens after the first (seconds)."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"kvevict": {"policy": "none"}},
        },
    }
    last = None
    count = 0
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            count += 1
            if last is not None and started.is_set():
                out.append(now - last)
            last = now
            if count == 10:
                started.set()  # heavy requests may come
    return None


def heavy(url: str, ids: list[int], kv: dict, new_tokens: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {
            "max_new_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"kvevict": kv},
        },
    }
    r = requests.post(url + "/generate", json=body, timeout=1200)
    r.raise_for_status()
    return r.json()["meta_info"]


def scenario(url: str, tok, name: str, kv: dict | None, args: argparse.Namespace, seed: int) -> dict:
    small = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Count slowly from {i} upwards, one number per line."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(args.small)
    ]
    prompts = [
        tok.encode(log_text(tok, args.heavy_tokens, seed * 100 + j) + "\nSummarize.")
        for j in range(args.heavy)
    ]
    if kv is not None and args.warm:
        # the heavy prompts go into the cache first (`none`, one token): the measured requests then
        # prefill almost nothing, and in branch scope their first compression covers the whole prompt
        for p in prompts:
            heavy(url, p, {"policy": "none"}, 1)
        if kv.get("policy") != "none":
            kv = {**kv, "config": {**kv.get("config", {}), "scope": "branch"}}
    gaps: list[float] = []
    started = [threading.Event() for _ in small]
    threads = [
        threading.Thread(target=stream_gaps, args=(url, ids, args.small_tokens, ev, gaps))
        for ids, ev in zip(small, started, strict=True)
    ]
    for t in threads:
        t.start()
    for ev in started:
        ev.wait(600)
    metas: list[dict] = []
    if kv is not None:
        hs = [
            threading.Thread(target=lambda p=p: metas.append(heavy(url, p, kv, args.heavy_new)))
            for p in prompts
        ]
        for h in hs:
            h.start()
        for h in hs:
            h.join()
    for t in threads:
        t.join()
    gaps.sort()
    comp = [m["kvevict"][0]["seconds"] for m in metas if m.get("kvevict")]
    med = statistics.median(gaps)
    return {
        "scenario": name,
        "gaps": len(gaps),
        "p50_ms": round(1000 * med, 1),
        "p99_ms": round(1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 1),
        "max_ms": round(1000 * gaps[-1], 1),
        "gaps_over_1s": sum(g > 1.0 for g in gaps),
        "heavy_compress_s": [round(x, 3) for x in comp],
    }


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server on the way out
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", default=[], help="NAME=extra server flags (repeatable)")
    ap.add_argument("--policy", default="criticalkv", help="the heavy requests' policy")
    ap.add_argument("--budget", default="256")
    ap.add_argument("--heavy", type=int, default=3, help="heavy requests arriving at once")
    ap.add_argument("--heavy-tokens", type=int, default=2000)
    ap.add_argument(
        "--heavy-new",
        type=int,
        default=8,
        help="tokens each heavy request generates (a split compression commits while it decodes)",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="cache the heavy prompts first, so that the largest gap is their compression, not their prefill",
    )
    ap.add_argument("--small", type=int, default=4)
    ap.add_argument("--small-tokens", type=int, default=250)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/stall-prefill-and-compression"))
    args = ap.parse_args()
    configs = [c.split("=", 1) for c in (args.config or ["nocap="])]
    args.out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(default_model_path())
    budget = int(args.budget) if args.budget.isdigit() else args.budget
    rows = []
    for cname, flags in configs:
        srv = Server(
            [
                "--max-total-tokens",
                "40000",
                "--kv-policy",
                "snapkv",
                "--chunked-prefill-size",
                "8192",
                *shlex.split(flags),
            ],
            log_path=args.out / f"server-{cname}.log",
        )
        with srv:
            seed = 1
            for rep in range(args.repeats):
                for name, kv in [
                    ("alone", None),
                    ("heavy-none", {"policy": "none"}),
                    (f"heavy-{args.policy}", {"policy": args.policy, "budget": budget}),
                ]:
                    seed += 1
                    row = {"config": cname, "repeat": rep, **scenario(srv.url, tok, name, kv, args, seed)}
                    # the longest one scheduler step spent compressing so far (only the heavy requests
                    # of the last scenario compress): the stall compression itself adds
                    info = srv.server_info()["internal_states"][0].get("kvevict", {})
                    row["step_compress_max_s"] = info.get("step_seconds_max")
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
                    requests.post(srv.url + "/flush_cache", timeout=60)
    (args.out / "stall.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2) + "\n"
    )
    print(
        f"{'config':>8} {'scenario':>16} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'>1 s':>5} "
        f"{'step max s':>10}  heavy compress s"
    )
    for r in rows:
        print(
            f"{r['config']:>8} {r['scenario']:>16} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} {r['max_ms']:8.1f} "
            f"{r['gaps_over_1s']:5d} {r['step_compress_max_s']!s:>10}  {r['heavy_compress_s']}"
        )


if __name__ == "__main__":
    main()
