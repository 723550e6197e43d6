"""One server request under OpenMP's wait policies, on an idle machine and beside busy processes.

Each variant starts its own server (`--kv-policy d2o --kv-budget 256`), sends a warm-up request, then
times the same greedy request (a 120-line log prompt, 1,337 tokens for SmolLM2; 64 decoded tokens,
ignore_eos) `--repeats` times after a cache flush. A loaded variant runs `scripts/cpu_burner.sh N` beside the server for its
whole life. Variants are `idle|load` : `default|passive|active`, where `default` leaves
`OMP_WAIT_POLICY` empty (libgomp then prints a warning and keeps its built-in policy: spin a while,
then sleep).

    HF_HUB_OFFLINE=1 python benchmarks/omp_wait.py --out results/omp-wait

Run it with nothing else on the machine: the loaded variants bring their own load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sgl_kvevict.serve.serverproc import Server

REPO = Path(__file__).resolve().parents[1]
POLICY_VALUES = {"default": "", "passive": "PASSIVE", "active": "ACTIVE"}
PROMPT = "Summarize the following log.\n" + "\n".join(f"line {i}: disk ok, fan ok" for i in range(120))


def run_variant(variant: str, repeats: int, burners: int) -> dict:
    load, policy = variant.split(":")
    if load not in ("idle", "load") or policy not in POLICY_VALUES:
        raise SystemExit(f"bad variant {variant!r}: want idle|load : {'|'.join(POLICY_VALUES)}")
    burner = None
    if load == "load":
        burner = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "cpu_burner.sh"), str(burners)], start_new_session=True
        )
    try:
        t0 = time.perf_counter()
        args = ["--kv-policy", "d2o", "--kv-budget", "256", "--max-total-tokens", "8000"]
        with Server(args, env={"OMP_WAIT_POLICY": POLICY_VALUES[policy]}, timeout=1200) as srv:
            start_s = time.perf_counter() - t0
            srv.generate(text="hi", max_new_tokens=4)
            seconds = []
            for _ in range(repeats):
                srv.flush()
                t1 = time.perf_counter()
                out = srv.generate(text=PROMPT, max_new_tokens=64, ignore_eos=True, timeout=1800)
                seconds.append(time.perf_counter() - t1)
            prompt_tokens = out["meta_info"]["prompt_tokens"]
    finally:
        if burner is not None:
            os.killpg(burner.pid, signal.SIGTERM)
            burner.wait(timeout=30)
    row = {
        "variant": variant,
        "start_s": round(start_s, 1),
        "request_s": [round(s, 2) for s in seconds],
        "best_s": round(min(seconds), 2),
        "prompt_tokens": prompt_tokens,
    }
    print(f"[omp_wait] {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="idle:default,idle:passive,load:default,load:passive,load:active")
    ap.add_argument("--repeats", type=int, default=3, choices=range(1, 21), metavar="[1-20]")
    ap.add_argument("--burners", type=int, default=2, choices=range(1, 17), metavar="[1-16]")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "omp-wait")
    a = ap.parse_args()
    rows = [run_variant(v, a.repeats, a.burners) for v in a.variants.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "omp_wait.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        f"One request ({rows[0]['prompt_tokens']} prompt tokens, 64 decoded), d2o at 256, "
        f"{os.cpu_count()} cores; load = `scripts/cpu_burner.sh {a.burners}` beside the server.",
        f"Command: `python benchmarks/omp_wait.py --variants {a.variants} --repeats {a.repeats}`",
        "",
        "| variant | server start s | request s (each) | best s |",
        "|---|---|---|---|",
    ]
    for r in rows:
        each = " ".join(f"{s:.2f}" for s in r["request_s"])
        lines.append(f"| {r['variant']} | {r['start_s']} | {each} | {r['best_s']} |")
    (a.out / "omp_wait.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
