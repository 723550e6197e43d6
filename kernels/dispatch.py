"""Backend choice shared by every kernel: Triton on CUDA tensors, torch reference elsewhere."""

from __future__ import annotations

import os

import torch

ENV_FLAG = "KVEVICT_TRITON"


def use_triton(tensor: torch.Tensor) -> bool:
    """True for CUDA tensors, or when KVEVICT_TRITON=1 (CPU + TRITON_INTERPRET=1, for tests).

    Read at call time (not import time) so a test subprocess can opt in without reloading modules.
    """
    return bool(tensor.is_cuda) or os.environ.get(ENV_FLAG, "") == "1"


def next_pow2(x: int) -> int:
    """Triton block sizes must be powers of two."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()
