"""CPU compatibility: a pure-torch stand-in for the few `sgl_kernel` helpers SGLang's CPU path imports.

PyPI has no CPU build of `sgl_kernel`, yet `mem_cache/allocation.py` imports one of its functions at
module load when the device is CPU. We install a meta-path finder at the *end* of `sys.meta_path`
(through a `.pth` file, so it is in place in every process SGLang spawns). It only answers when no
other finder found a real `sgl_kernel`, so it can never shadow the real package on a GPU machine.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys

STUB_NAME = "sgl_kernel"
# submodules SGLang imports at module load on CUDA outside a try (`layers/attention/triton_backend.py`:
# `utils`; `layers/quantization/gguf.py`: `quantization`; `mem_cache/memory_pool_host.py` and
# `pool_host/`: `kvcacheio`), served by the same stand-in: scripts/gpu_session.sh runs the Triton backend
# on a GPU without sgl-kernel. Submodules SGLang imports inside a try (`allreduce`, `flash_attn`) are left
# unanswered, so its fallbacks still see an ImportError.
SUBMODULES = ("sgl_kernel.utils", "sgl_kernel.quantization", "sgl_kernel.kvcacheio")
_STUB_MODULE = "sgl_kvevict.cpu_compat.sgl_kernel_stub"


class _StubFinder(importlib.abc.MetaPathFinder):
    """Serves `sgl_kernel` from our stub, but only as the last resort."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401
        if fullname not in (STUB_NAME, *SUBMODULES):
            return None
        stub = importlib.util.find_spec(_STUB_MODULE)
        if stub is None:
            return None
        spec = importlib.util.spec_from_file_location(fullname, stub.origin)
        if fullname == STUB_NAME:  # a package with no folder: only SUBMODULES import below it (this finder)
            spec.submodule_search_locations = []
        return spec


def install_finder() -> None:
    """Append the finder once; called from the `.pth` file at interpreter start.

    Under `TRITON_INTERPRET=1` it also arms the interpreter's bfloat16 `tl.dot` fix (see `triton_interp`),
    so SGLang's Triton attention backend computes right on CPU tensors in every server process."""
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder())
    from sgl_kvevict.cpu_compat import triton_interp

    triton_interp.install()


def real_sgl_kernel_present() -> bool:
    """True when an installed `sgl_kernel` exists (found by any finder but ours)."""
    for finder in sys.meta_path:
        if isinstance(finder, _StubFinder):
            continue
        find = getattr(finder, "find_spec", None)
        if find is not None and find(STUB_NAME, None) is not None:
            return True
    return False
