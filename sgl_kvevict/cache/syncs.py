"""Counting host synchronisation on any device: what would make the host wait for a GPU, counted while
running on the CPU. The tests, the engine benchmark and (under KVEVICT_DEBUG) the decode step's recall on
a real server use it."""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that make the host wait for the device on CUDA: a scalar read (`.item()`, `int(t)`, `bool(t)`,
# `.any()` in an `if`), or an output whose size depends on the data (`nonzero`, boolean-mask indexing,
# `repeat_interleave` without `output_size`, `unique`, `masked_select`).
SCALAR_READ = "aten::_local_scalar_dense"
DATA_DEPENDENT = frozenset(
    {
        "aten::nonzero",
        "aten::masked_select",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::equal",
    }
)


class SyncCounter(TorchDispatchMode):
    """Counts every op in the step that forces a host sync on CUDA (see `SCALAR_READ`, `DATA_DEPENDENT`),
    plus `Tensor.tolist()` calls (on CPU they never reach the dispatcher, on CUDA they copy to the host).

    Runs on CPU: what it counts is what *would* wait for the GPU, whatever the device here."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self._tolist = None

    def _add(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten::{func._schema.name.split('::')[-1]}"
        if name == SCALAR_READ or name in DATA_DEPENDENT:
            self._add(name)
        elif name == "aten::repeat_interleave" and (kwargs or {}).get("output_size") is None:
            self._add(name)
        elif name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
        ):
            self._add("aten::index(bool mask)")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        counter, orig, owner = self, torch.Tensor.tolist, threading.get_ident()

        def tolist(t, *a, **k):
            if threading.get_ident() == owner:  # like the dispatch mode, this thread's calls only
                counter._add("Tensor.tolist")
            return orig(t, *a, **k)

        self._tolist = orig
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
