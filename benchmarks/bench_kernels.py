"""Time of each kernel at the shapes the server sees (SmolLM2-135M-like): the torch reference on this
CPU, and on a CUDA device the torch reference and the Triton kernel side by side.

30 layers, Hkv=3, Hq=9, D=64, hidden=576, bf16 pool; regions of 512, 2048 and 8192 tokens; the host
tier's ops (page summaries, page scores, the batched host swap) at 2K, 8K and 32K host columns. Prints a
table (best of a few repeats, so other load on the machine inflates it less); no assertions: the
kernels' agreement is what `tests/test_kernels.py` and `tests/test_page_scores.py` check.

    python benchmarks/bench_kernels.py [--threads T] [--repeats R]
    python benchmarks/bench_kernels.py --device cuda --repeats 20 --out results/kernels-cuda/bench.json

On CUDA each timed call ends with `torch.cuda.synchronize()`, so a row is the kernel's whole time
(launches included). The host swap runs twice there: with the host store in pinned CPU memory (the
tier's layout on a GPU: the kernel reads and writes it through its mapped pointer) and, for scale, with
the store on the device.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from timing import times_ms  # benchmarks/timing.py (scripts run with benchmarks/ on sys.path)

from sgl_kvevict import kernels as K

LAYERS, HKV, HQ, D, HIDDEN, W, LAG = 30, 3, 9, 64, 576, 32, 128
SIZES = (512, 2048, 8192)
HOST_SIZES = (2048, 8192, 32768)
PAGE, R = 8, 64
DTYPE = torch.bfloat16


REPEATS = 5
Row = dict[str, object]


def best_ms(fn: Callable[[], object], setup: Callable[[], None] | None = None, sync: bool = False) -> float:
    """Best wall time in ms over REPEATS runs (after one warm-up); `sync`: wait for the GPU in each."""

    def run() -> None:
        fn()
        if sync:
            torch.cuda.synchronize()

    return min(times_ms(run, REPEATS, setup))


def sorted_keep(n: int, b: int, heads: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(n, generator=gen)[:b].sort().values for _ in range(heads)])


class Bench:
    """Times one op under each backend the device offers ("torch"; on CUDA also "triton")."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.backends = ("torch", "triton") if device == "cuda" else ("torch",)
        self.rows: list[Row] = []

    def add(
        self,
        op: str,
        n: int,
        params: str,
        fns: dict[str, Callable[[], object]],
        per: int = 1,
        setup: Callable[[], None] | None = None,
    ) -> None:
        """`fns[backend]` runs the op once; `per`: layers one call covers (its time is divided by it)."""
        ms = {b: best_ms(fns[b], setup, self.device == "cuda") / per for b in self.backends}
        self.rows.append({"op": op, "n": n, "params": params, "ms_per_layer": ms})


def bench_region(bench: Bench, n: int, gen: torch.Generator) -> None:
    """The policies' ops over a region of `n` tokens."""
    dev = bench.device
    pool = n + 1024
    slots = torch.randperm(pool, generator=gen)[:n].to(dev)
    kb = torch.randn(pool, HKV, D, generator=gen).to(DTYPE).to(dev)
    vb = torch.randn(pool, HKV, D, generator=gen).to(DTYPE).to(dev)
    q = torch.randn(HQ, W, D, generator=gen).to(DTYPE).to(dev)
    o_proj = (torch.randn(HQ, D, HIDDEN, generator=gen) * 0.05).to(DTYPE).to(dev)
    b = n // 4

    bench.add(
        "window_attention",
        n,
        f"W={W}",
        {
            "torch": lambda: K.window_attention_ref(q, kb, slots, D**-0.5),
            "triton": lambda: K.window_attention_triton(q, kb, slots, D**-0.5),
        },
    )
    lag_slots = slots[: (n // LAG) * LAG]
    bench.add(
        "lag_scores (K+V)",
        n,
        f"lag={LAG}",
        {
            "torch": lambda: (K.lag_scores_ref(kb, lag_slots, LAG), K.lag_scores_ref(vb, lag_slots, LAG)),
            "triton": lambda: (
                K.lag_scores_triton(kb, lag_slots, LAG),
                K.lag_scores_triton(vb, lag_slots, LAG),
            ),
        },
    )
    bench.add(
        "vo_norms",
        n,
        f"hidden={HIDDEN}",
        {
            "torch": lambda: K.vo_norms_ref(vb, slots, o_proj),
            "triton": lambda: K.vo_norms_triton(vb, slots, o_proj),
        },
    )

    work: dict[str, torch.Tensor] = {}

    def reset() -> None:
        work["k"], work["v"] = kb.clone(), vb.clone()

    keep = sorted_keep(n, b, HKV, gen).to(dev)
    bench.add(
        "d2o_merge prefill",
        n,
        f"b={b}",
        {
            "torch": lambda: K.d2o_merge_ref(work["k"], work["v"], slots, keep, None, 0.7, True),
            "triton": lambda: K.d2o_merge_triton(work["k"], work["v"], slots, keep, None, 0.7, True),
        },
        setup=reset,
    )
    keep_dec = torch.arange(n - 16, device=dev).expand(HKV, n - 16)  # decode step: 16 evicted tokens
    tau = torch.full((HKV,), 0.5, device=dev)
    bench.add(
        "d2o_merge decode",
        n,
        "E=16",
        {
            "torch": lambda: K.d2o_merge_ref(work["k"], work["v"], slots, keep_dec, tau, 0.7, False),
            "triton": lambda: K.d2o_merge_triton(work["k"], work["v"], slots, keep_dec, tau, 0.7, False),
        },
        setup=reset,
    )

    bufs: dict[str, list[torch.Tensor]] = {}

    def reset_all() -> None:
        bufs["k"] = [kb.clone() for _ in range(LAYERS)]
        bufs["v"] = [vb.clone() for _ in range(LAYERS)]

    keep_l = torch.stack([sorted_keep(n, b, HKV, gen) for _ in range(LAYERS)]).to(dev)
    bench.add(
        "compact (all layers)",
        n,
        f"b={b}",
        {
            "torch": lambda: K.compact_ref(bufs["k"], bufs["v"], slots, keep_l),
            "triton": lambda: K.compact_triton(bufs["k"], bufs["v"], slots, keep_l),
        },
        per=LAYERS,
        setup=reset_all,
    )


def bench_host(bench: Bench, e: int, gen: torch.Generator) -> None:
    """The host tier's ops for a branch of `e` host columns: one layer's page summaries and page scores,
    and a swap of R entries per layer and head over all layers."""
    dev = bench.device
    keys = torch.randn(e, HKV, D, generator=gen).to(DTYPE).to(dev)
    q = torch.randn(W, HQ, D, generator=gen).to(DTYPE).to(dev)
    summ = K.page_summaries_ref(keys, PAGE)
    bench.add(
        "page_summaries",
        e,
        f"page={PAGE}",
        {
            "torch": lambda: K.page_summaries_ref(keys, PAGE),
            "triton": lambda: K.page_summaries_triton(keys, PAGE),
        },
    )
    bench.add(
        "page_scores minmax",
        e,
        f"W={W}",
        {
            "torch": lambda: K.page_scores_ref(q, *summ, "minmax", D**-0.5, "sum"),
            "triton": lambda: K.page_scores_triton(q, *summ, "minmax", D**-0.5, "sum"),
        },
    )
    slots_n = 4096
    kbs = [torch.randn(slots_n, HKV, D, generator=gen).to(DTYPE).to(dev) for _ in range(LAYERS)]
    vbs = [torch.randn(slots_n, HKV, D, generator=gen).to(DTYPE).to(dev) for _ in range(LAYERS)]
    dev_slots = torch.stack(
        [torch.randperm(slots_n, generator=gen)[: R * HKV].view(HKV, R) for _ in range(LAYERS)]
    )
    cols = torch.stack([torch.randperm(e, generator=gen)[: R * HKV].view(HKV, R) for _ in range(LAYERS)])
    dev_slots, cols = dev_slots.to(dev), cols.to(dev)
    stores = {"host": torch.randn(LAYERS, e, HKV, D, generator=gen).to(DTYPE)}
    if dev == "cuda":
        stores = {"pinned host": stores["host"].pin_memory(), "device": stores["host"].to(dev)}
    for where, hk in stores.items():
        hv = hk.clone().pin_memory() if hk.is_pinned() else hk.clone()  # a clone is pageable
        bench.add(
            f"host_swap ({where})",
            e,
            f"R={R}",
            {
                "torch": lambda hk=hk, hv=hv: K.host_swap_ref(kbs, vbs, dev_slots, hk, hv, cols),
                "triton": lambda hk=hk, hv=hv: K.host_swap_triton(kbs, vbs, dev_slots, hk, hv, cols),
            },
            per=LAYERS,
        )


def main() -> None:
    global REPEATS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per op (1..1000)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    if not 1 <= args.repeats <= 1000:
        parser.error("--repeats must be in 1..1000")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    REPEATS = args.repeats
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    bench = Bench(args.device)
    for n in SIZES:
        bench_region(bench, n, gen)
    for e in HOST_SIZES:
        bench_host(bench, e, gen)
    where = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, threads={torch.get_num_threads()}"
    )
    print(f"torch {torch.__version__}, {where}, dtype={DTYPE}, Hkv={HKV}, Hq={HQ}, D={D}")
    head = "".join(f"{f'{b} ms/layer':>18}" for b in bench.backends)
    print(f"{'op':<26}{'N':>6}  {'params':<12}{head}{f'{bench.backends[-1]} ms/{LAYERS} layers':>24}")
    for row in bench.rows:
        ms = row["ms_per_layer"]
        cells = "".join(f"{ms[b]:>18.3f}" for b in bench.backends)
        print(
            f"{row['op']:<26}{row['n']:>6}  {row['params']:<12}{cells}{ms[bench.backends[-1]] * LAYERS:>24.2f}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "device": where, "repeats": REPEATS}
        args.out.write_text(json.dumps({"meta": meta, "rows": bench.rows}, indent=1))


if __name__ == "__main__":
    main()
