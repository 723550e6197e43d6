"""One SmolLM2-135M MLP projection (1536 x 576) in torch's bf16 and as `cpu_compat/bf16_linear.py` forms
it (fp64, rounded once), 1 thread, median of 20 after one warm-up, at 2, 16 and 512 tokens.

    python benchmarks/bf16_linear.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import times_ms  # benchmarks/timing.py (scripts run with benchmarks/ on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sgl_kvevict.cpu_compat import bf16_linear  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    print(f"native bf16 on this CPU: {bf16_linear.native_bf16()}")
    for n in (2, 16, 512):
        x = torch.randn(n, 576, dtype=torch.bfloat16)
        for name, fn in (
            ("bf16", lambda x=x: F.linear(x, w)),
            ("fp64", lambda x=x: bf16_linear.linear(x, w, None)),
        ):
            print(f"{n:4d} tokens, {name}: {sorted(times_ms(fn, 20))[10]:.3f} ms")


if __name__ == "__main__":
    main()
