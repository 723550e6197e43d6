"""The compression engine on SGLang's real pools: what one scheduler step costs at batch 1-64.

For each policy and batch size, a decode batch of B requests (each an own region of N tokens on 30
layers) goes through the scheduler's compression hook once (`hooks._compress_batch`, what
`check_decode_mem` calls), and the step is measured three ways, each on a fresh batch:

- aten ops: top-level `aten::` events in the torch profiler (ops called by other aten ops not counted);
- host syncs: ops that make the host wait for the device on CUDA (`sgl_kvevict.tools.pools.SyncCounter`:
  `aten::_local_scalar_dense` = `.item()`/`int(t)`/`bool(t)`, data-dependent shapes, `.tolist()`);
- wall time of the step, divided by the requests it compressed (best of `--reps`).

With `--capture`, it also measures the window-query capture of one decode forward (the hook on every
layer's `RadixAttention.forward`, `capture.Store.write`) at the same batch sizes: top-level aten ops,
host syncs and wall time for all layers. The capture used to push per request and layer (B x layers
pushes per forward); the store writes once per layer, whatever the batch.

`HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/bench_engine.py --capture --out results/engine-batch/after.txt`
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from sgl_kvevict.cache import capture
from sgl_kvevict.cache import state as st
from sgl_kvevict.serve import hooks
from sgl_kvevict.tools.pools import Pools, SyncCounter

POLICIES = {
    "streaming": {},
    "knorm": {},
    "h2o": {},
    "snapkv": {},
    "lagkv": {"lag": 64},
    "d2o": {},
    "graphkv": {},
    "criticalkv": {},
}


def _top_level_aten(prof) -> int:
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        n += p is None
    return n


def measure(pools: Pools, policy: str, batch: int, n: int, budget, reps: int) -> dict:
    cfg = POLICIES[policy]

    def fresh():
        return pools.batch(batch, n, policy, budget, cfg)

    b = fresh()
    hooks._compress_batch(b)  # warm-up
    compressed = sum(1 for r in b.reqs if st.get(r).counters.compressions > 0)
    walls = []
    for _ in range(reps):
        b = fresh()
        t0 = time.perf_counter()
        hooks._compress_batch(b)
        walls.append(time.perf_counter() - t0)
    b = fresh()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        hooks._compress_batch(b)
    ops = _top_level_aten(prof)
    b = fresh()
    with SyncCounter() as sc:
        hooks._compress_batch(b)
    wall = min(walls)
    return {
        "policy": policy,
        "batch": batch,
        "compressed": compressed,
        "ops": ops,
        "syncs": sc.total,
        "sync_kinds": dict(sorted(sc.counts.items())),
        "ms_step": wall * 1e3,
        "ms_per_req": wall * 1e3 / max(1, compressed),
    }


def measure_capture(batch: int, layers: int, reps: int) -> dict:
    """One decode forward's capture writes (every layer) for `batch` capturing requests."""
    hq, d, w = 8, 64, 32
    store = capture.Store(batch + 1, layers, w, hq, d, batch, torch.bfloat16, "cpu")
    for row in range(1, batch + 1):
        store.ensure(row, w, 0)
    fb = SimpleNamespace(
        req_pool_indices=torch.arange(1, batch + 1),
        positions=torch.randint(0, 4096, (batch,)),
        forward_mode=SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False),
    )
    q = torch.randn(batch, hq * d, dtype=torch.bfloat16)

    def forward() -> None:
        for layer in range(layers):
            store.write(layer, q, fb)

    forward()
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        forward()
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward()
    with SyncCounter() as sc:
        forward()
    return {"ops": _top_level_aten(prof), "syncs": sc.total, "ms": min(walls) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=512, help="region tokens per request")
    ap.add_argument("--budget", type=int, default=256, help="token budget (beyond sinks and recent)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--capture", action="store_true", help="also measure the window-query capture")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.policies.split(",")
    bad = [p for p in names if p not in POLICIES]
    if bad:
        print(f"unknown policy {bad}; valid choices: {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    batches = [int(x) for x in args.batches.split(",")]
    if not batches or min(batches) < 1 or max(batches) > 256:
        print("--batches: integers in [1, 256]", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    pools = Pools(layers=args.layers, max_reqs=max(batches), max_len=args.tokens + 8)
    lines = [
        f"# bench_engine: {args.layers} layers, 2 KV heads x 4 query heads, head_dim 64, bf16, region "
        f"{args.tokens} tokens/request, budget {args.budget}, 1 thread, load avg {os.getloadavg()[0]:.1f}",
        f"# torch {torch.__version__}; ms = best of {args.reps}; ops = top-level aten ops in the step; "
        "syncs = host syncs on CUDA (SyncCounter)",
        f"{'policy':<11} {'batch':>5} {'compr':>5} {'ops':>7} {'ops/req':>8} {'syncs':>6} "
        f"{'ms/step':>9} {'ms/req':>8} {'x b1':>6}  sync kinds",
    ]
    print("\n".join(lines), flush=True)
    for p in names:
        base = None
        for bsz in batches:
            r = measure(pools, p, bsz, args.tokens, args.budget, args.reps)
            base = base or r["ms_per_req"]
            line = (
                f"{p:<11} {bsz:>5} {r['compressed']:>5} {r['ops']:>7} {r['ops'] / bsz:>8.1f} {r['syncs']:>6} "
                f"{r['ms_step']:>9.1f} {r['ms_per_req']:>8.2f} {r['ms_per_req'] / base:>6.2f}  {r['sync_kinds']}"
            )
            print(line, flush=True)
            lines.append(line)
    if args.capture:
        head = f"# capture: one decode forward, {args.layers} layers, 8 query heads x 64, window 32, bf16"
        lines += [head, f"{'batch':>5} {'ops':>7} {'syncs':>6} {'ms':>8} {'pushes before':>14}"]
        print("\n".join(lines[-2:]), flush=True)
        for bsz in batches:
            r = measure_capture(bsz, args.layers, args.reps)
            line = f"{bsz:>5} {r['ops']:>7} {r['syncs']:>6} {r['ms']:>8.2f} {bsz * args.layers:>14}"
            print(line, flush=True)
            lines.append(line)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
