"""The compression step alone, thousands of times, on SGLang's real pools: does it grow the C heap?

No model, no server: random policies, batch sizes, region lengths and budgets go through the scheduler's
compression hook (`hooks._compress_batch`) on `sgl_kvevict.tools.pools.Pools`, and every `--every` steps
glibc's heap counts (`runtime.heap_stats`: in use, free but kept, mmapped) and the process's anonymous
RSS are printed. In-use memory rising with the steps would be a leak of ours; free memory rising would
be the allocator keeping compression's varying-size temporaries (see `bench_soak_rss.py` for the server).

    HF_HUB_OFFLINE=1 nice -n 10 python benchmarks/bench_heap_churn.py --steps 2000 --every 200
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from sgl_kvevict.cache import runtime
from sgl_kvevict.serve import hooks
from sgl_kvevict.tools.pools import Pools

POLICIES = {"streaming": {}, "knorm": {}, "h2o": {}, "snapkv": {}, "lagkv": {"lag": 32}, "d2o": {}}


def anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=200)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--max-seconds", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    pools = Pools(layers=30, max_reqs=args.max_batch, max_len=args.max_tokens + 8)
    t0 = time.time()
    print(f"{'step':>6} {'s':>6} {'anon MiB':>9} {'in use':>8} {'free':>8} {'mmapped':>8}", flush=True)
    for step in range(args.steps + 1):
        last = step == args.steps or bool(args.max_seconds and time.time() - t0 > args.max_seconds)
        if step % args.every == 0 or last:
            h = runtime.heap_stats()
            print(
                f"{step:>6} {time.time() - t0:>6.0f} {anon_mib():>9.1f} {h['heap_in_use_mib']:>8.1f} "
                f"{h['heap_free_mib']:>8.1f} {h['heap_mmapped_mib']:>8.1f}",
                flush=True,
            )
        if last:
            break
        policy = rng.choice(list(POLICIES))
        n = rng.randrange(200, args.max_tokens)
        b = pools.batch(
            rng.randrange(1, args.max_batch + 1), n, policy, rng.randrange(64, n // 2), POLICIES[policy]
        )
        hooks._compress_batch(b)


if __name__ == "__main__":
    main()
