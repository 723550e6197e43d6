"""D2O's merge against its own floor: the similarity matmuls alone, at bench_policies' shapes, 1 thread.

Why: the nearest-kept match needs every (evicted, kept) cosine, E x b x D multiply-adds per KV head and
layer, whatever the code around it; timing those matmuls alone (the same chunked `bmm` calls the merge
makes, nothing else) says how far the whole merge is from what this CPU can do.

Shapes: 30 layers, Hkv=3, D=64, a region of N tokens in a `[2N, 3, 64]` bf16 pool, `kept` per head
(bench_policies' budget 0.5 keeps 4132 of 8192: sinks 4 + recent 32 + 4096). Random keys: the match's
cost does not depend on the values. Process CPU time, median of --repeats runs (one layer), times 30.

    python benchmarks/bench_d2o_floor.py --sizes 2048:1060 8192:4132 8192:8175
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
from timing import times_ms  # benchmarks/timing.py (scripts run with benchmarks/ on sys.path)

d2o = importlib.import_module("sgl_kvevict.kernels.d2o_merge")
LAYERS, HKV, D = 30, 3, 64


def cpu_ms(fn, repeats: int, setup=None) -> float:
    """Median process CPU ms of `repeats` runs after one warm-up."""
    return statistics.median(times_ms(fn, repeats, setup, clock=time.process_time))


def measure(n: int, b: int, repeats: int) -> tuple[float, float]:
    """CPU ms for 30 layers: the match's matmuls alone, and the whole merge (`d2o_merge_ref`)."""
    g = torch.Generator().manual_seed(n + b)
    kb = torch.randn(2 * n, HKV, D, generator=g).to(torch.bfloat16)
    vb = torch.randn(2 * n, HKV, D, generator=g).to(torch.bfloat16)
    slots = torch.randperm(2 * n, generator=g)[:n]
    keep = torch.stack([torch.randperm(n, generator=g)[:b].sort().values for _ in range(HKV)])
    evicted = d2o._evicted(keep, n)
    e = n - b
    flat = torch.nn.functional.normalize(kb[slots].float(), dim=-1).view(-1, D)
    cb = max(1, min(b, d2o._MAX_SIMS // HKV))
    ce = max(1, min(e, d2o._MAX_SIMS // (HKV * cb)))
    kc = [d2o._rows(flat, keep[:, c0 : c0 + cb], HKV).transpose(1, 2) for c0 in range(0, b, cb)]
    ke = [d2o._rows(flat, evicted[:, e0 : e0 + ce], HKV) for e0 in range(0, e, ce)]

    def matmuls() -> None:
        for x in ke:
            for y in kc:
                torch.bmm(x, y)

    work: list[torch.Tensor] = []

    def fresh() -> None:
        work[:] = [kb.clone(), vb.clone()]

    def merge() -> None:
        d2o.d2o_merge_ref(work[0], work[1], slots, keep, None, 0.7, True)

    return cpu_ms(matmuls, repeats) * LAYERS, cpu_ms(merge, repeats, fresh) * LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["2048:1060", "8192:4132", "8192:8175"], help="N:kept")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| N | kept | evicted | GFLOP (30 layers) | matmuls only, ms | whole merge, ms | merge / matmuls |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for spec in args.sizes:
        n, b = (int(x) for x in spec.split(":"))
        floor, whole = measure(n, b, args.repeats)
        gflop = 2 * HKV * (n - b) * b * D * LAYERS / 1e9
        print(f"| {n} | {b} | {n - b} | {gflop:.1f} | {floor:.0f} | {whole:.0f} | {whole / floor:.2f} |")


if __name__ == "__main__":
    main()
