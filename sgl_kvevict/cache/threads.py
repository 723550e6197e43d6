"""Thread pinning: compression and each layer's decode-step recall run with one OpenMP thread on a CPU
(`KVEVICT_COMPRESS_THREADS`): both are many small tensor ops, which a second thread slows down."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

THREADS = int(os.environ.get("KVEVICT_COMPRESS_THREADS", "1"))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Compression is many small tensor ops: on a CPU, one OpenMP thread is much faster than several
    fighting over cores (measured 0.8 ms vs 150 ms for one LagKV score on a loaded 2-core machine)."""
    prev = torch.get_num_threads()
    try:
        if THREADS and THREADS != prev:
            torch.set_num_threads(THREADS)
        yield
    finally:
        if torch.get_num_threads() != prev:
            torch.set_num_threads(prev)
