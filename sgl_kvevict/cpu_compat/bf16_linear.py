"""bf16 linear layers computed in fp64 on a CPU without bf16 instructions.

Where the CPU has neither AVX512-BF16 nor AMX, torch's bf16 GEMM takes a slow path: on a 2-core AVX2
EPYC, one SmolLM2 MLP projection over 512 tokens took 99.6 ms in bf16 and 23.9 ms as "convert to
fp64, multiply, round back" (1 thread; measured by `benchmarks/bf16_linear.py`, removed after commit
55a1648).
The model stays bf16 (weights, activations, the KV pool); only the product is formed wider.

Why fp64 and not fp32: bf16 products are exact in either, but fp32 sums round differently with the
batch's shape (MKL blocks a 2-row and a 300-row product differently), so a token computed in a bigger
batch could differ from the same token computed alone, and the suite's token-identity checks (a
budget covering the context equals `none`) failed. Summed in fp64 and rounded once to bf16, a row's
result does not depend on the rows beside it (`tests/test_bf16_linear.py`).

The fp64 copy of each weight is kept (8 bytes per parameter, 4x the bf16 bytes) while
all copies together stay under `CACHE_BYTES`; converting per call cost more than the product itself
at decode sizes. A weight written in place (its version counter moves) is converted afresh; weights past
the cap are converted per call.

Registered on SGLang's `UnquantizedLinearMethod.apply` by the plugin's entry point only when asked for:
`KVEVICT_BF16_LINEAR=fp64`, which `python -m sgl_kvevict.launch` sets on a machine without CUDA (a
user of stock `sglang.launch_server` on such a CPU sets it). It changes nothing on a GPU, on a CPU with
native bf16, for other dtypes, or without that switch (unset, or `native`).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger("sgl_kvevict")
TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
CACHE_BYTES = 2 << 30  # fp64 weight copies kept per process, at most


class WideWeights:
    """The process's fp64 copies of bf16 weights, keyed by weight (weakly: a dead weight's copy goes)."""

    def __init__(self) -> None:
        # id(weight) -> (the weight, weakly; its version when converted; the fp64 copy)
        self.copies: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
        self.kept_bytes = 0  # the bytes of the copies, counted as they come and go
        self.logged = False  # the one log line saying the products are formed in fp64

    def drop(self, key: int) -> None:
        hit = self.copies.pop(key, None)
        if hit is not None:
            self.kept_bytes -= hit[2].nbytes

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The fp64 copy of `weight`, kept while the copies fit `CACHE_BYTES`."""
        key = id(weight)
        hit = self.copies.get(key)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]
        self.drop(key)
        w64 = weight.double()
        if self.kept_bytes + w64.nbytes <= CACHE_BYTES:
            self.copies[key] = (weakref.ref(weight, lambda _, key=key: self.drop(key)), weight._version, w64)
            self.kept_bytes += w64.nbytes
        return w64


# Registry (a cache keyed by weight): weights are the process's, so one per process, whatever the servers.
WIDE = WideWeights()


ENV = "KVEVICT_BF16_LINEAR"


def enabled() -> bool:
    """Whether this process forms bf16 products in fp64: asked for (`KVEVICT_BF16_LINEAR=fp64`) on a
    CPU without native bf16."""
    return os.environ.get(ENV, "") == "fp64" and not native_bf16()


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX), or the operator asked for it."""
    if os.environ.get(ENV, "") == "native":
        return True
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(p is None for p in probes):
        return True  # a torch that cannot tell: leave SGLang's products alone
    return any(bool(p()) for p in probes)


def wide(weight: torch.Tensor) -> torch.Tensor:
    """The fp64 copy of `weight`, kept while the copies fit `CACHE_BYTES` (`WIDE`)."""
    return WIDE.get(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` of bf16 operands formed in fp64 and rounded back to bf16."""
    out = F.linear(x.double(), wide(weight), None if bias is None else bias.double())
    return out.to(x.dtype)


def apply(original: Any, method: Any, layer: Any, x: torch.Tensor, bias: Any = None, *args, **kwargs):
    """AROUND hook: bf16 CPU inputs go through `linear`; everything else to SGLang's own `apply`."""
    w = getattr(layer, "weight", None)
    if (
        args
        or kwargs
        or x.device.type != "cpu"
        or x.dtype != torch.bfloat16
        or not isinstance(w, torch.Tensor)
        or w.dtype != torch.bfloat16
    ):
        return original(method, layer, x, bias, *args, **kwargs)
    if not WIDE.logged:
        WIDE.logged = True
        logger.info("bf16 linear layers compute in fp64 on this CPU (no AVX512-BF16 or AMX)")
    return linear(x, w, bias)
