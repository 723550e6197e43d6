"""Each policy on one live server, side by side: KV held, slots freed, compression time, decode speed.

One SGLang server (`--kv-policy d2o --kv-budget B`) serves every policy through per-request overrides, so
`none` and the policies run on the same process, model and pool, one request at a time (a long prompt,
then a fixed number of decode tokens, ignore_eos). Decode tokens/s is measured from the stream: tokens
after the first, over the time from the first to the last. `none` runs first and last; its mean is the
baseline of the ratio column.

    HF_HUB_OFFLINE=1 python benchmarks/bench_server.py --prompt-tokens 2000 --decode-tokens 300 \
        --budget 512 --out results/server-one-request

Run it alone on the machine: decode speed on a 2-core CPU halves when anything else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import requests
from pydantic import BaseModel
from transformers import AutoTokenizer

from sgl_kvevict.model import default_model_path
from sgl_kvevict.scenarios.text import log_text
from sgl_kvevict.serve.serverproc import Server

POLICIES = ["none", "streaming", "knorm", "h2o", "snapkv", "lagkv", "d2o", "graphkv", "criticalkv", "none"]


class Row(BaseModel):
    policy: str
    prompt_tokens: int
    decode_tokens: int
    kv_tokens: int
    logical_tokens: int
    slots_freed: int
    compressions: int
    compress_seconds: float
    ttft_s: float
    decode_tok_s: float


def stream_one(url: str, ids: list[int], n: int, kv: dict) -> tuple[dict, float, float]:
    """Stream a greedy request; returns (final meta_info, ttft seconds, decode tokens/s)."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"kvevict": kv},
        },
    }
    t0 = time.perf_counter()
    first = last = None
    meta: dict = {}
    with requests.post(url + "/generate", json=body, stream=True, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or b"[DONE]" in line:
                continue
            now = time.perf_counter()
            first = first or now
            last = now
            meta = json.loads(line[5:])["meta_info"]
    done = meta["completion_tokens"]
    rate = (done - 1) / (last - first) if last and first and last > first else 0.0
    return meta, first - t0, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--decode-tokens", type=int, default=300)
    ap.add_argument("--budget", default="512")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--max-total-tokens", type=int, default=40000)
    ap.add_argument("--out", default=None, help="directory for bench_server.json / .md")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(default_model_path())
    names = args.policies.split(",")
    rows: list[Row] = []
    print(f"[bench] load average before start: {os.getloadavg()}", file=sys.stderr)
    with Server(
        ["--max-total-tokens", str(args.max_total_tokens), "--kv-policy", "d2o", "--kv-budget", args.budget]
    ) as srv:
        # warm-up: the first requests of a fresh server are slow
        srv.generate("Hello", max_new_tokens=8)
        for i, name in enumerate(names):
            text = log_text(tok, args.prompt_tokens, seed=1000 + i) + "\nSummarize the log above."
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            kv = {"policy": name, "budget": float(args.budget) if "." in args.budget else int(args.budget)}
            meta, ttft, rate = stream_one(srv.url, ids, args.decode_tokens, kv)
            info = meta["kvevict_stream"][-1]
            rows.append(
                Row(
                    policy=name,
                    prompt_tokens=meta["prompt_tokens"],
                    decode_tokens=meta["completion_tokens"],
                    kv_tokens=info["kv_tokens"],
                    logical_tokens=info["logical_tokens"],
                    slots_freed=info["evicted"],
                    compressions=info["compressions"],
                    compress_seconds=info["seconds"],
                    ttft_s=round(ttft, 3),
                    decode_tok_s=round(rate, 2),
                )
            )
            r = rows[-1]
            print(
                f"[bench] {i + 1}/{len(names)} {name}: kv {r.kv_tokens}/{r.logical_tokens}, {r.decode_tok_s} tok/s",
                file=sys.stderr,
            )
            srv.flush()
    base = [r.decode_tok_s for r in rows if r.policy == "none"]
    base_rate = sum(base) / len(base) if base else 0.0
    lines = [
        f"prompt {args.prompt_tokens} tokens + {args.decode_tokens} decode tokens, budget {args.budget}, one request at a time, "
        f"one server; `none` = mean of its {len(base)} runs ({base_rate:.2f} tok/s)",
        "",
        "| policy | KV held | logical tokens | slots freed | compressions | compress s | TTFT s | decode tok/s | vs none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r.decode_tok_s / base_rate if base_rate else 0.0
        lines.append(
            f"| {r.policy} | {r.kv_tokens} | {r.logical_tokens} | {r.slots_freed} | {r.compressions} | {r.compress_seconds:.3f} | {r.ttft_s:.2f} | {r.decode_tok_s:.2f} | {ratio:.2f}x |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_server.json").write_text(json.dumps([r.model_dump() for r in rows], indent=1))
        (out / "bench_server.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
