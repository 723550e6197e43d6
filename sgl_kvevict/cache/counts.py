"""Counts kept on the device until someone reads them (a leaf: the request state and the totals share it)."""

from __future__ import annotations

import torch


class LazyCount:
    """A count that grows by device tensors without reading them (a read inside the compression step is
    a host sync that stalls a GPU stream): the sync happens once, where the count is reported.

    Pending tensors are summed on the device every `FOLD` additions, so memory stays bounded when
    nobody reads the count for a long time."""

    FOLD = 64

    def __init__(self) -> None:
        self.known = 0
        self.pending: list[torch.Tensor] = []

    def add(self, x: int | float | torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            self.known += int(x)
            return
        self.pending.append(x.detach().reshape(()).to(torch.int64))
        if len(self.pending) >= self.FOLD:
            self.pending = [torch.stack(self.pending).sum()]

    def value(self) -> int:
        if self.pending:
            self.known += int(torch.stack(self.pending).sum())
            self.pending = []
        return self.known
