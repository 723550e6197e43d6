"""One worker vs N workers behind sglang-router: the replay benchmark through the router, side by side.

    HF_HUB_OFFLINE=1 python benchmarks/bench_cluster.py --workers 1,2 --policies none,lagkv \\
        --sessions 16 --turns 3 --out results/router-workers

For each worker count and each policy (`NAME[=BUDGET]`) it starts a cluster (`sgl_kvevict.cluster`:
workers started with `--kv-policy NAME --kv-budget BUDGET`, behind the router), replays the agent
sessions through the router's URL (`benchmarks/replay.py --server-mode url`), then stops it. Each
policy gets its own workers because sglang-router 0.3.2 re-encodes `/generate` requests from its own
typed fields and drops `custom_params`: a per-request override never reaches a worker behind it (the
replay checks the policy each response reports and counts a mismatch as an error). The
router runs its `manual` policy keyed by session (`X-SMG-Routing-Key`): replay sends token ids, and the
router's cache-aware policy matches request *text*, so with ids it cannot tell sessions apart.
One worker also goes through the router, so both sides pay the same proxy hop.

On a machine with fewer cores than workers, the workers share the cores: read the ratios, not the
absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import replay  # noqa: E402

from sgl_kvevict.cluster import Cluster  # noqa: E402

KEYS = [
    ("requests", "turns", "{:d}"),
    ("errors", "errors", "{:d}"),
    ("radix_hit_rate", "radix hit", "{:.2f}"),
    ("prefill_recomputed", "prefill recomputed", "{:d}"),
    ("e2e_seconds", "wall s", "{:.0f}"),
    ("output_tps", "output tok/s", "{:.2f}"),
    ("ttft_p50", "TTFT p50 s", "{:.2f}"),
    ("kv_per_session", "KV/session", "{:.0f}"),
]


def fmt(v, f: str) -> str:
    if v is None:
        return "-"
    return f.format(int(v)) if f == "{:d}" else f.format(v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2", help="comma list of worker counts")
    p.add_argument("--policies", default="none,lagkv")
    p.add_argument("--budget", default="0.5", help="budget of a policy named without one (lagkv=25%%)")
    p.add_argument("--router-policy", default="manual", choices=["manual", "cache_aware", "round_robin"])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--tool-tokens", default="300,900")
    p.add_argument("--max-total-tokens", type=int, default=12000, help="KV pool of each worker")
    p.add_argument("--policy-config", default='{"lagkv": {"lag": 32}}')
    p.add_argument("--out", default="results/router-workers")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[int, list[dict]] = {}
    confs = json.loads(a.policy_config)
    for n in [int(x) for x in a.workers.split(",")]:
        rows[n] = []
        for spec in a.policies.split(","):
            policy, _, budget = spec.partition("=")
            args = ["--kv-policy", policy, "--max-total-tokens", str(a.max_total_tokens)]
            if policy != "none":
                args += ["--kv-budget", budget or a.budget]
                if confs.get(policy):
                    args += ["--kv-policy-config", json.dumps(confs[policy])]
            log_dir = out / f"workers-{n}" / policy
            log_dir.mkdir(parents=True, exist_ok=True)
            print(f"[bench_cluster] {n} worker(s), policy {spec}", flush=True)
            rows[n] += run_one(
                a, n, args, policy if policy == "none" else f"{policy}={budget or a.budget}", log_dir
            )
    counts = sorted(rows)
    lines = [
        f"Command: `{' '.join(sys.argv)}`",
        "",
        "| policy | metric | "
        + " | ".join(f"{n} worker(s)" for n in counts)
        + f" | {counts[-1]} vs {counts[0]} |",
        "|---|---|" + "---|" * (len(counts) + 1),
    ]
    for i, s0 in enumerate(rows[counts[0]]):
        for key, name, f in KEYS:
            vals = [rows[n][i].get(key) for n in counts]
            ratio = vals[-1] / vals[0] if vals[0] and vals[-1] is not None else None
            lines.append(
                f"| {s0['label']} | {name} | "
                + " | ".join(fmt(v, f) for v in vals)
                + f" | {'-' if ratio is None else f'{ratio:.2f}x'} |"
            )
    table = "\n".join(lines) + "\n"
    (out / "cluster.md").write_text(table)
    (out / "cluster.json").write_text(json.dumps({"command": sys.argv, "summaries": rows}, indent=1))
    print(table)


def run_one(a: argparse.Namespace, n: int, worker_args: list[str], spec: str, log_dir: Path) -> list[dict]:
    """One cluster of `n` workers started with the run's policy, the replay through its router."""
    router_args = ["--assignment-mode", "min_group"] if a.router_policy == "manual" else []
    with Cluster(n, worker_args, policy=a.router_policy, log_dir=log_dir, router_args=router_args) as c:
        cfg = replay.parse(
            [
                "--scenarios",
                "agent",
                "--sessions",
                str(a.sessions),
                "--turns",
                str(a.turns),
                "--concurrency",
                str(a.concurrency),
                "--max-new-tokens",
                str(a.max_new_tokens),
                "--tool-tokens",
                a.tool_tokens,
                "--max-total-tokens",
                str(a.max_total_tokens * n),
                "--policies",
                spec,
                "--no-baseline",
                "--policy-config",
                a.policy_config,
                "--server-mode",
                "url",
                "--url",
                c.url,
                "--worker-urls",
                ",".join(w.url for w in c.workers),
                "--routing-key",
                "--score",
                "none",
                "--out",
                str(log_dir),
            ]
        )
        chat = replay.rc.ChatIds(_tok())
        for w in c.workers:  # a fresh worker's first passes are slow: keep them out of the runs
            replay.warmup(w.url, chat, None)
        return replay.main(cfg)["summary"]


def _tok():
    from transformers import AutoTokenizer

    from sgl_kvevict.model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


if __name__ == "__main__":
    main()
