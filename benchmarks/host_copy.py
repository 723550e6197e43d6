"""What a request pays to continue a stored history with recall on: the copy of the history's host entries
(`HostPool.copy`, called by `demote.take` when a turn, a retried turn or a fork branch adopts a stored
compressed node; the node keeps its own entries). Host to host, SmolLM2-135M's shapes (30 layers, 3 KV
heads, head dim 64, bf16), no model, no server.

    python benchmarks/host_copy.py --host 2048,8192,32768

Printed per host size (columns, one evicted entry per layer and KV head each): the median seconds of
`--repeat` copies and the bytes copied (K and V). On a GPU the pool is pinned host memory and the copy
stays on the host; here both tiers are in RAM, so the seconds are this CPU's only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sgl_kvevict.cache import host  # noqa: E402

LAYERS, KV_HEADS, DIM = 30, 3, 64


def measure(columns: int, repeat: int) -> tuple[float, int]:
    """(median seconds of one copy of a `columns`-column branch, bytes copied)."""
    pool = host.HostPool(LAYERS, KV_HEADS, DIM, 2 * columns, torch.bfloat16)
    src = host.HostEntries()
    pool.append(src, pool.alloc(columns), None)
    pool.k[:, src.cols] = torch.randn(LAYERS, columns, KV_HEADS, DIM).to(torch.bfloat16)
    pool.v[:, src.cols] = torch.randn(LAYERS, columns, KV_HEADS, DIM).to(torch.bfloat16)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = pool.copy(src)
        times.append(time.perf_counter() - t0)
        assert out is not None and torch.equal(pool.k[:, out.cols], pool.k[:, src.cols])
        pool.release(out)
    return statistics.median(times), columns * pool.column_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="2048,8192,32768", help="host columns of the branch")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    print("| host columns | copy s (median) | bytes copied |")
    print("|---|---|---|")
    for n in (int(x) for x in args.host.split(",")):
        print(f"[host_copy] {n} columns ...", file=sys.stderr, flush=True)
        s, b = measure(n, args.repeat)
        print(f"| {n:,} | {s:.3f} | {b / 1e6:.0f} MB |", flush=True)


if __name__ == "__main__":
    main()
