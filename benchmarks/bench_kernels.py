"""CPU time of each kernel's torch reference at the shapes the CPU runner sees (SmolLM2-135M-like).

30 layers, Hkv=3, Hq=9, D=64, hidden=576, bf16 pool; regions of 512, 2048 and 8192 tokens. Prints a
table (best of a few repeats, so other load on the machine inflates it less); no assertions.
Run: python benchmarks/bench_kernels.py [--threads T] [--repeats R]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from timing import times_ms  # benchmarks/timing.py (scripts run with benchmarks/ on sys.path)

from sgl_kvevict.kernels import compact_ref, d2o_merge_ref, lag_scores_ref, vo_norms_ref, window_attention_ref

LAYERS, HKV, HQ, D, HIDDEN, W, LAG = 30, 3, 9, 64, 576, 32, 128
SIZES = (512, 2048, 8192)
DTYPE = torch.bfloat16


REPEATS = 5


def best_ms(fn: Callable[[], object], setup: Callable[[], None] | None = None) -> float:
    """Best wall time in ms over REPEATS runs (after one warm-up)."""
    return min(times_ms(fn, REPEATS, setup))


def sorted_keep(n: int, b: int, heads: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(n, generator=gen)[:b].sort().values for _ in range(heads)])


def bench_size(n: int, gen: torch.Generator) -> list[tuple[str, int, str, float, float]]:
    """Rows (op, N, params, ms per layer, ms for all layers) for one region size."""
    rows: list[tuple[str, int, str, float, float]] = []
    pool = n + 1024
    slots = torch.randperm(pool, generator=gen)[:n]
    kb = torch.randn(pool, HKV, D, generator=gen).to(DTYPE)
    vb = torch.randn(pool, HKV, D, generator=gen).to(DTYPE)
    q = torch.randn(HQ, W, D, generator=gen).to(DTYPE)
    o_proj = (torch.randn(HQ, D, HIDDEN, generator=gen) * 0.05).to(DTYPE)
    b = n // 4

    ms = best_ms(lambda: window_attention_ref(q, kb, slots, D**-0.5))
    rows.append(("window_attention", n, f"W={W}", ms, ms * LAYERS))

    lag_slots = slots[: (n // LAG) * LAG]
    ms = best_ms(lambda: (lag_scores_ref(kb, lag_slots, LAG), lag_scores_ref(vb, lag_slots, LAG)))
    rows.append(("lag_scores (K+V)", n, f"lag={LAG}", ms, ms * LAYERS))

    ms = best_ms(lambda: vo_norms_ref(vb, slots, o_proj))
    rows.append(("vo_norms", n, f"hidden={HIDDEN}", ms, ms * LAYERS))

    work: dict[str, torch.Tensor] = {}

    def reset() -> None:
        work["k"], work["v"] = kb.clone(), vb.clone()

    keep = sorted_keep(n, b, HKV, gen)
    ms = best_ms(lambda: d2o_merge_ref(work["k"], work["v"], slots, keep, None, 0.7, True), reset)
    rows.append(("d2o_merge prefill", n, f"b={b}", ms, ms * LAYERS))

    keep_dec = torch.arange(n - 16).expand(HKV, n - 16)  # decode step: 16 evicted tokens
    ms = best_ms(lambda: d2o_merge_ref(work["k"], work["v"], slots, keep_dec, 0.5, 0.7, False), reset)
    rows.append(("d2o_merge decode", n, "E=16", ms, ms * LAYERS))

    bufs: dict[str, list[torch.Tensor]] = {}

    def reset_all() -> None:
        bufs["k"] = [kb.clone() for _ in range(LAYERS)]
        bufs["v"] = [vb.clone() for _ in range(LAYERS)]

    keep_l = torch.stack([sorted_keep(n, b, HKV, gen) for _ in range(LAYERS)])
    ms = best_ms(lambda: compact_ref(bufs["k"], bufs["v"], slots, keep_l), reset_all)
    rows.append(("compact (all layers)", n, f"b={b}", ms / LAYERS, ms))
    return rows


def main() -> None:
    global REPEATS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args()
    REPEATS = args.repeats
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = [row for n in SIZES for row in bench_size(n, gen)]
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, dtype={DTYPE}, Hkv={HKV}, Hq={HQ}, D={D}"
    )
    print(f"{'op':<22}{'N':>6}  {'params':<12}{'ms/layer':>10}{f'ms/{LAYERS} layers':>16}")
    for name, n, params, per_layer, total in rows:
        print(f"{name:<22}{n:>6}  {params:<12}{per_layer:>10.2f}{total:>16.1f}")


if __name__ == "__main__":
    main()
