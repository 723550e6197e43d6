"""One layer of extend attention over a cached prefix (SmolLM2-135M's 9 query and 3 KV heads of 64, bf16),
SGLang's `torch_native` function against `cpu_compat/prefix_attention.py`, median of 5 after one warm-up,
on this machine's torch threads. Requests as (cached prefix, new tokens).

    python benchmarks/prefix_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from timing import times_ms  # benchmarks/timing.py (scripts run with benchmarks/ on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

from sgl_kvevict.cpu_compat import prefix_attention  # noqa: E402

STOCK = TorchNativeAttnBackend._run_sdpa_forward_extend
SHAPES = [(0, 512), (1500, 1), (1500, 150), (2000, 40), (4000, 200), (300, 700)]


def main() -> None:
    print(f"torch threads: {torch.get_num_threads()}")
    for p, e in SHAPES:
        n = p + e
        q = torch.randn(e, 9, 64).bfloat16()
        k, v = torch.randn(n, 3, 64).bfloat16(), torch.randn(n, 3, 64).bfloat16()
        args = (q, torch.empty_like(q), k, v, torch.arange(n)[None], torch.tensor([0]), torch.tensor([n]))
        args += (torch.tensor([p]), torch.tensor([e]), None)
        kw = dict(scaling=0.125, enable_gqa=True, causal=True, is_cross_attn=False, sliding_window_size=None)
        stock = sorted(times_ms(lambda a=args, k=kw: STOCK(None, *a, **k), 5))[2]
        mine = sorted(times_ms(lambda a=args, k=kw: prefix_attention.apply(STOCK, None, *a, **k), 5))[2]
        print(
            f"prefix {p:5d}, {e:4d} new: sglang {stock:7.1f} ms, short path {mine:7.1f} ms ({stock / mine:.1f}x)"
        )


if __name__ == "__main__":
    main()
