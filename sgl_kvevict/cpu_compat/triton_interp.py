"""One fix to Triton's CPU interpreter so SGLang's Triton attention kernels compute right on CPU tensors.

Triton's interpreter (`TRITON_INTERPRET=1`, triton 3.x) stores bfloat16 values as their raw uint16 bits and
its `create_dot` hands those bits straight to `numpy.matmul`, so every `tl.dot` on bfloat16 operands
multiplies integers (elementwise arithmetic is fine: it upcasts first). SGLang's decode and extend
attention kernels take `tl.dot(q, k)` on the bf16 pool, so under the interpreter their scores are garbage.
We widen bfloat16 dot operands to float32 (exact: the bits shifted up 16) before the matmul, which is what
a GPU's tensor cores do (bf16 products accumulated in fp32). Nothing else in the interpreter is changed,
and nothing is patched unless `TRITON_INTERPRET=1` (`KVEVICT_NO_INTERP_FIX=1` leaves the interpreter
as shipped, to show the bug).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "triton.runtime.interpreter"


def patch_bf16_dot(interp) -> bool:
    """Wrap `interp.InterpreterBuilder.create_dot` once; True when the wrapper is (now) in place."""
    import numpy as np
    import triton.language as tl

    builder = interp.InterpreterBuilder
    if is_patched(interp):
        return True
    orig = builder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    return True


def is_patched(interp) -> bool:
    """Whether the interpreter's `create_dot` is the wrapper `patch_bf16_dot` defined here."""
    return interp.InterpreterBuilder.create_dot.__module__ == __name__


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        patch_bf16_dot(module)


class _InterpFinder(importlib.abc.MetaPathFinder):
    """Finds `triton.runtime.interpreter` the normal way and patches it right after it executes."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def install() -> None:
    """Under `TRITON_INTERPRET=1` only: patch the interpreter now if loaded, else when it is imported."""
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("KVEVICT_NO_INTERP_FIX") == "1":
        return
    if TARGET in sys.modules:
        patch_bf16_dot(sys.modules[TARGET])
    elif not any(isinstance(f, _InterpFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _InterpFinder())
