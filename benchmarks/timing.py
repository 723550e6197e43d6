"""Wall-clock timing shared by the micro-benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def times_ms(fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None) -> list[float]:
    """Wall times in ms of `repeats` runs after one warm-up; `setup` runs untimed before each."""
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return times
