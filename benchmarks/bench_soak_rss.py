"""RSS of a stock server beside compressing ones under the same soak: whose growth is it?

Starts each variant's server (all at once, idle ones sleep: `--sleep-on-idle`; or one after the other
with `--sequential`, where memory is short), then sends the soak of
`bench_soak.py` (same seed, so the same prompts, lengths, aborts and continuations) to them in turn, a
block of `--block` requests at a time, so every server sees the same machine load. After each block the
scheduler process's RSS is sampled. Variants:

- `stock`: `--kv-policy none` and requests without `custom_params` (SGLang's own CPU path, no hooks).
- `d2o`: `--kv-policy d2o --kv-budget 256` and the soak's per-request policies (every registered one).
- `d2o-malloc`: as `d2o` with glibc's allocator bounded: `MALLOC_ARENA_MAX=2` and a fixed
  `MALLOC_MMAP_THRESHOLD_` (blocks of 1 MiB and up are mmapped and unmapped when freed).
- `stock-malloc`: as `stock` with the same allocator bound.
- `d2o-recall`: as `d2o` with the host tier on (`--kv-recall-tokens 64`, the host pool at its default size) and
  every compressing request in branch scope, so evictions are demoted and later turns recall; after the
  final flush the host tier must be empty (`host_used_after_flush` 0).

Writes `rss.csv`, `rss.png` (if matplotlib imports), `rss.json` and the printed table to `--out`.

    HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/bench_soak_rss.py --requests 2000 --max-minutes 55 \
        --variants stock,d2o,d2o-malloc --out results/soak-stock-vs-policy
"""

from __future__ import annotations

import argparse
import csv
import json
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_soak import CHECKED_ENV, Client, drive, flush_until_whole  # noqa: E402

from sgl_kvevict.serve.serverproc import Server  # noqa: E402

MALLOC_BOUND = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
POLICY_ARGS = ["--kv-policy", "d2o", "--kv-budget", "256"]
HOST_ARGS = ["--kv-recall-tokens", "64"]  # the host tier at its default size


class Variant(NamedTuple):
    args: list[str]  # the server's flags
    env: dict[str, str]
    overrides: bool  # the soak's per-request policies (`custom_params`)
    scope: str | None = None  # every compressing request's scope


VARIANTS: dict[str, Variant] = {
    "stock": Variant(["--kv-policy", "none"], {}, False),
    "d2o": Variant(POLICY_ARGS, {}, True),
    "d2o-malloc": Variant(POLICY_ARGS, MALLOC_BOUND, True),
    "stock-malloc": Variant(["--kv-policy", "none"], MALLOC_BOUND, False),
    "d2o-recall": Variant(POLICY_ARGS + HOST_ARGS, {}, True, "branch"),
}


LIVE: list[Server] = []


def stop_all(*_: object) -> None:
    """SIGTERM: stop the servers first (requests in flight then fail fast instead of being waited for)."""
    for srv in LIVE:
        srv.stop()
    sys.exit(1)


def scheduler(pid: int) -> psutil.Process:
    """The server's scheduler process (SGLang titles it `sglang::scheduler`): where the model runs."""
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "scheduler" in p.name() or "scheduler" in " ".join(p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            pass
    raise RuntimeError(f"no scheduler process under pid {pid}")


def mem(p: psutil.Process) -> dict[str, float]:
    """RSS, its anonymous part (the heaps: glibc arenas, mmapped tensors) and the thread count."""
    status = Path(f"/proc/{p.pid}/status").read_text()
    anon = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("RssAnon:"))
    return {
        "rss_mib": round(p.memory_info().rss / (1 << 20), 1),
        "anon_mib": round(anon / 1024, 1),
        "threads": p.num_threads(),
    }


HEAP_KEYS = ("heap_in_use_mib", "heap_free_mib", "heap_mmapped_mib")


def heap(url: str) -> dict[str, float | None]:
    """glibc's count of the scheduler's C heap (in use, free but kept, mmapped), from `/server_info`;
    None on a stock server, which runs none of our hooks."""
    try:
        info = (
            requests.get(url + "/server_info", timeout=60).json()["internal_states"][0].get("kvevict") or {}
        )
    except (requests.RequestException, ValueError, KeyError, IndexError):
        info = {}
    return {k: info.get(k) for k in HEAP_KEYS}


def main() -> None:
    signal.signal(signal.SIGTERM, stop_all)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="stock,d2o,d2o-malloc", help=f"comma list of {sorted(VARIANTS)}")
    ap.add_argument("--requests", type=int, default=2000, help="per server")
    ap.add_argument("--warmup", type=int, default=100, help="requests per server before the baseline")
    ap.add_argument("--block", type=int, default=25, help="requests per server per turn (and per sample)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-total-tokens", type=int, default=40000)
    ap.add_argument("--max-prompt", type=int, default=600, help="longest first-turn prompt, tokens")
    ap.add_argument("--max-minutes", type=float, default=None, help="per group: no new block after this")
    ap.add_argument("--sequential", action="store_true", help="one server at a time (less memory)")
    ap.add_argument("--resume", action="store_true", help="keep --out's measured variants, run the rest")
    ap.add_argument("--out", type=Path, default=Path("results/soak-stock-vs-policy"))
    args = ap.parse_args()
    names = args.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {sorted(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    summary: dict[str, dict] = {}
    if args.resume and (args.out / "rss.json").exists():
        summary = json.loads((args.out / "rss.json").read_text())["summary"]
        with open(args.out / "rss.csv") as f:
            rows = [
                {k: v if k == "variant" else float(v or "nan") for k, v in r.items()}
                for r in csv.DictReader(f)
            ]
        print(f"[rss] resuming: {sorted(summary)} already measured", file=sys.stderr, flush=True)
    todo = [n for n in names if n not in summary]
    groups = [[n] for n in todo] if args.sequential else [todo]
    for group in groups:  # results are written after each group: a cut-off run keeps what it measured
        soak(group, args, rows, summary)
        write(args.out, rows, summary, [n for n in names if n in summary], vars(args))


def soak(names: list[str], args: argparse.Namespace, rows: list[dict], summary: dict[str, dict]) -> None:
    """Start the servers of `names` together, warm each up, then send them the soak block by block in
    turn until `args.requests` each or `args.max_minutes`; sample, flush, stop."""
    t_start = time.time()
    with ExitStack() as stack:
        servers, clients, scheds, nxt, secs = {}, {}, {}, {}, {}
        for name in names:
            srv_args, env = VARIANTS[name].args, VARIANTS[name].env
            srv = Server(
                ["--max-total-tokens", str(args.max_total_tokens), *srv_args],
                env={**CHECKED_ENV, **env},
                log_path=args.out / f"server-{name}.log",
            )
            LIVE.append(srv)
            servers[name] = stack.enter_context(srv)
            scheds[name] = scheduler(srv.proc.pid)
            summary[name] = {"args": srv_args, "env": env, "rss_mib_start": mem(scheds[name])["rss_mib"]}
        for name in names:  # warm-up: its own seed, not sampled
            v = VARIANTS[name]
            warm = Client(servers[name].url, args.seed + 1, args.max_prompt, v.overrides, v.scope)
            drive(warm, 0, args.warmup, args.concurrency)
            summary[name]["warmup_errors"] = warm.stats.errors
            clients[name] = Client(servers[name].url, args.seed, args.max_prompt, v.overrides, v.scope)
            nxt[name], secs[name] = 0, 0.0
            rows.append(
                {
                    "variant": name,
                    "requests": 0,
                    "seconds": 0.0,
                    **mem(scheds[name]),
                    **heap(servers[name].url),
                }
            )
        while any(nxt[n] < args.requests for n in names):
            if args.max_minutes is not None and time.time() - t_start > 60 * args.max_minutes:
                print(f"[rss] time limit reached: {nxt}", file=sys.stderr, flush=True)
                break
            for name in names:
                t0 = time.time()
                nxt[name] = drive(
                    clients[name], nxt[name], min(nxt[name] + args.block, args.requests), args.concurrency
                )
                secs[name] += time.time() - t0
                row = {"variant": name, "requests": nxt[name], "seconds": round(secs[name], 1)}
                row.update(mem(scheds[name]))
                row.update(heap(servers[name].url))
                rows.append(row)
                print(f"[rss] {json.dumps(row)}", file=sys.stderr, flush=True)
        for name in names:
            st = clients[name].stats
            before = mem(scheds[name])
            try:
                pool = flush_until_whole(servers[name].url)
            except KeyError:  # a stock server reports no pool state of ours
                requests.post(servers[name].url + "/flush_cache", timeout=60)
                pool = {}
            summary[name].update(
                requests=nxt[name],
                seconds=round(secs[name], 1),
                finished=st.finished,
                compressed=st.compressed,
                errors=st.errors,
                pool_whole_after_flush=pool["available_tokens"] == pool["max_total_tokens"]
                if "available_tokens" in pool
                else None,
                host_after_flush=pool.get("host"),  # the host tier's totals (None without one)
                sched_end_before_flush=before,
                sched_end_after_flush=mem(scheds[name]),
                server_alive=servers[name].alive(),
                wall_seconds=round(time.time() - t_start, 1),
            )


def write(out: Path, rows: list[dict], summary: dict, names: list[str], argv: dict) -> None:
    with open(out / "rss.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)), restval="")
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"{'variant':<13} {'requests':>8} {'s/req':>6} {'after warm-up':>13} {'end':>7} {'growth':>7} "
        f"{'%':>6} {'2nd half':>8} {'flushed':>7} {'threads':>7} {'host':>6}  (scheduler RSS, MiB; host: "
        "columns in use after the flush)"
    ]
    for name in names:
        rs = [r for r in rows if r["variant"] == name]
        s = summary[name]
        base, end = rs[0]["rss_mib"], rs[-1]["rss_mib"]
        mid = min(rs, key=lambda r: abs(r["requests"] - rs[-1]["requests"] / 2))["rss_mib"]
        n = s["requests"]
        s.update(rss_mib_after_warmup=base, rss_mib_end=end, growth_mib=round(end - base, 1))
        lines.append(
            f"{name:<13} {n:>8} {s['seconds'] / max(n, 1):>6.2f} {base:>13.0f} {end:>7.0f} {end - base:>+7.0f} "
            f"{100 * (end - base) / base:>+5.1f}% {end - mid:>+8.0f} "
            f"{s['sched_end_after_flush']['rss_mib']:>7.0f} {rs[-1]['threads']:>7} "
            f"{(s.get('host_after_flush') or {}).get('host_used', '-'):>6}"
        )
    table = "\n".join(lines)
    print(table)
    (out / "table.txt").write_text(table + "\n")
    (out / "rss.json").write_text(
        json.dumps({"args": argv, "summary": summary}, indent=2, default=str) + "\n"
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[rss] matplotlib not importable: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for i, name in enumerate(names):
        rs = [r for r in rows if r["variant"] == name]
        x = [r["requests"] for r in rs]
        axes[0].plot(x, [r["rss_mib"] for r in rs], marker=".", label=name, color=f"C{i}")
        axes[1].plot(x, [r["rss_mib"] - rs[0]["rss_mib"] for r in rs], marker=".", label=name, color=f"C{i}")
        for key, style in (("heap_in_use_mib", "-"), ("heap_free_mib", "--")):
            pts = [
                (r["requests"], r[key])
                for r in rs
                if isinstance(r.get(key), float | int) and r[key] == r[key]
            ]
            if pts:
                axes[2].plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    color=f"C{i}",
                    marker=".",
                    label=f"{name} {key[5:-4].replace('_', ' ')}",
                )
    axes[0].set_title("scheduler RSS (MiB)")
    axes[1].set_title("scheduler RSS growth after warm-up (MiB)")
    axes[2].set_title("scheduler C heap by glibc (MiB; our hooks report it)")
    for ax in axes:
        ax.set_xlabel("requests after warm-up (same soak on every server)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=110)


if __name__ == "__main__":
    main()
