"""What D2O's accumulated scores cost per compression step, next to h2o's window reading.

Why: the paper sums every query's attention over the whole run; doing that literally needs a second
attention pass over the context at every decode step. `scores: accumulated` instead adds the window
attention every attention policy computes anyway to carried per-token sums, once per compression. This
times, per compression step on all layers (SmolLM2-135M shapes: 30 layers, 3 KV heads, 9 query heads,
head_dim 64, W = 32), the D2O selection (score + top-k) with carried state, for both readings, and the
window attention itself for scale, with random K/Q (the cost does not depend on the values). The
literal alternative (an exact running sum) would need one more [Hq, 1, N] attention per decode step
per layer, i.e. the window attention's cost / W on every step: printed as "per-step pass".

    HF_HUB_OFFLINE=1 python benchmarks/bench_d2o_scores.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from timing import times_ms  # benchmarks/timing.py

from sgl_kvevict import kernels, policies
from sgl_kvevict.policies.base import LayerView

LAYERS, HKV, HQ, D, W = 30, 3, 9, 64, 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print(
        "| N | window attention ms (all layers) | select ms, window | select ms, accumulated | extra | per-step pass ms |"
    )
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        row(n, args.repeats)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return sorted(times_ms(fn, repeats))[repeats // 2]


def row(n: int, repeats: int) -> None:
    kb = torch.randn(n, HKV, D)
    q = torch.randn(HQ, W, D)
    slots = torch.arange(n)
    budget = n // 2 - 36
    attn = kernels.window_attention(q, kb, slots, D**-0.5, causal=True)
    carried = torch.rand(HKV, n - 17)  # the kept tokens of the last step; 17 arrived since
    res = {}
    for reading in ("window", "accumulated"):
        pol = policies.build("d2o", {"scores": reading, "merge": False})
        views = [
            LayerView(layer, kb, kb, slots, 4, 32, 0, attn=attn, state={"carried": carried})
            for layer in range(LAYERS)
        ]
        res[reading] = median_ms(lambda p=pol, vs=views: [p.select(v, budget) for v in vs], repeats)
    wa = median_ms(
        lambda: [kernels.window_attention(q, kb, slots, D**-0.5, causal=True) for _ in range(LAYERS)], repeats
    )
    extra = res["accumulated"] - res["window"]
    print(
        f"| {n} | {wa:.1f} | {res['window']:.1f} | {res['accumulated']:.1f} | {extra:+.1f} | {wa / W:.2f} |"
    )


if __name__ == "__main__":
    main()
