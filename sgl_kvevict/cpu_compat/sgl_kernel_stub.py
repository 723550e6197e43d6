"""Pure-torch stand-ins for the `sgl_kernel` functions SGLang's CPU path calls (and, as `sgl_kernel.utils`,
the one SGLang's Triton backend asks on CUDA).

Loaded as the module `sgl_kernel` only when no real `sgl_kernel` is installed (see `__init__.py`).
Anything not provided here raises NotImplementedError when called, naming the function.
"""

from __future__ import annotations

import torch

IS_KVEVICT_STUB = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """Write each request's newly allocated slots into its req_to_token row, in batch order."""
    del max_context_len
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends, strict=True):
        n = e - s
        req_to_token[row, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def is_arch_support_pdl() -> bool:
    """`sgl_kernel.utils.is_arch_support_pdl`: no programmatic dependent launch without sgl-kernel's kernels."""
    return False


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in in sgl_kvevict.cpu_compat; this SGLang path needs a GPU"
        )

    _missing.__name__ = name
    return _missing
