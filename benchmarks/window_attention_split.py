"""The Triton window attention before and after its first pass was split over N, side by side in one
process on a CUDA GPU, with the torch reference: best and median ms of `--repeats` calls, and the largest
difference between the two kernels' outputs (they compute the same thing in another order).

"Before" is `kernels/window_attention.py` at `--before` (default 3c4bfe0, the last commit with one
program per query head in pass 1), read with `git show` and imported from a temporary file.

    python benchmarks/window_attention_split.py [--before COMMIT] [--repeats 200]

Shapes: SmolLM2-135M's (Hq 9, Hkv 3, D 64, bf16 pool), N = 512 to 32768 tokens; W = 32 causal (a
policy's window) and W = 1 (a decode step's recall query), reduce "max". Refuses without CUDA (exit 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from timing import times_ms  # benchmarks/timing.py (scripts run with benchmarks/ on sys.path)

from sgl_kvevict import kernels as K

HQ, HKV, D = 9, 3, 64
ROOT = Path(__file__).resolve().parents[1]


def load_before(commit: str):
    """The kernel module as it was at `commit`, its relative imports made absolute."""
    src = subprocess.run(
        ["git", "show", f"{commit}:kernels/window_attention.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    src = src.replace("from ._pool import", "from sgl_kvevict.kernels._pool import")
    src = src.replace("from .dispatch import", "from sgl_kvevict.kernels.dispatch import")
    path = Path(tempfile.mkdtemp()) / "window_attention_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("window_attention_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def times(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) ms over `repeats` calls, each waiting for the GPU, after 5 warm-ups."""

    def synced() -> None:
        fn()
        torch.cuda.synchronize()

    for _ in range(4):  # `times_ms` warms up once more
        synced()
    out = sorted(times_ms(synced, repeats))
    return out[0], out[len(out) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="3c4bfe0")
    ap.add_argument("--repeats", type=int, default=200, help="timed calls per cell (1..10000)")
    args = ap.parse_args()
    if not 1 <= args.repeats <= 10000:
        ap.error("--repeats must be in 1..10000")
    if not torch.cuda.is_available():
        print("window_attention_split: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    before = load_before(args.before)
    gen = torch.Generator().manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    print(
        f"{'N':>6} {'W':>3} {'causal':>6} | {'torch best/median ms':>22} | {'before':>16} | {'after':>16} | max|after-before|"
    )
    for n in (512, 2048, 8192, 32768):
        for w, causal in ((32, True), (1, False)):
            slots = torch.randperm(n + 1024, generator=gen)[:n].cuda()
            kb = torch.randn(n + 1024, HKV, D, generator=gen).bfloat16().cuda()
            q = torch.randn(HQ, w, D, generator=gen).bfloat16().cuda()
            args3 = (q, kb, slots, D**-0.5, causal, "max")
            diff = (
                (K.window_attention_triton(*args3) - before.window_attention_triton(*args3))
                .abs()
                .max()
                .item()
            )
            cells = [
                times(lambda f=f, a=args3: f(*a), args.repeats)
                for f in (K.window_attention_ref, before.window_attention_triton, K.window_attention_triton)
            ]
            shown = " | ".join(
                f"{f'{b:.3f}/{m:.3f}':>{width}}" for (b, m), width in zip(cells, (22, 16, 16), strict=True)
            )
            print(f"{n:>6} {w:>3} {str(causal):>6} | {shown} | {diff:.2e}")


if __name__ == "__main__":
    main()
