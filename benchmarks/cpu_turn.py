"""A multi-turn step on the CPU server, with the plugin's fp64 products (`cpu_compat/bf16_linear.py`, on
where the CPU lacks native bf16) and without them (`SGL_KVEVICT_BF16_LINEAR=native`: torch's bf16).

Per variant, one server (`--kv-policy d2o --kv-budget 256`; requests ask for `none`, so every token stays):
a warm-up, then a 1,500-token log prompt prefilled from an empty cache, a second turn that adds about 180
tokens over it (the prompt cached), and 32 decode steps on that history. The variants run one after
the other; run it on an otherwise idle machine.

    HF_HUB_OFFLINE=1 python benchmarks/cpu_turn.py --out results/cpu-turn
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from sgl_kvevict.model import default_model_path
from sgl_kvevict.scenarios.text import log_text
from sgl_kvevict.serve.serverproc import Server

VARIANTS = {"compat": {}, "sglang": {"SGL_KVEVICT_BF16_LINEAR": "native"}}
KV = {"policy": "none"}


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def run_variant(name: str, tok) -> dict:
    first = chat(tok, log_text(tok, 1500, 4242))
    turn = first + chat(tok, log_text(tok, 150, 99))
    args = ["--kv-policy", "d2o", "--kv-budget", "256", "--max-total-tokens", "8000"]
    with Server(args, env=VARIANTS[name], timeout=1200) as srv:
        srv.generate(text="hi", max_new_tokens=4, kv=KV)
        srv.flush()
        t0 = time.perf_counter()
        srv.generate(input_ids=first, max_new_tokens=1, kv=KV)
        t1 = time.perf_counter()
        srv.generate(input_ids=turn, max_new_tokens=1, kv=KV)
        t2 = time.perf_counter()
        out = srv.generate(input_ids=turn, max_new_tokens=33, ignore_eos=True, kv=KV)
        t3 = time.perf_counter()
    return {
        "variant": name,
        "prompt_tokens": len(first),
        "turn_tokens": len(turn) - len(first),
        "prefill_s": round(t1 - t0, 2),
        "turn_s": round(t2 - t1, 2),
        "decode_step_ms": round((t3 - t2) / 32 * 1000),
        "first_tokens": out["output_ids"][:8],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="compat,sglang", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument("--out", type=Path, default=None, help="folder for rows.json")
    a = ap.parse_args()
    names = a.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; valid: {sorted(VARIANTS)}")
    tok = AutoTokenizer.from_pretrained(default_model_path())
    rows = []
    for name in names:
        print(f"[cpu_turn] {name} ...", flush=True)
        rows.append(run_variant(name, tok))
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
