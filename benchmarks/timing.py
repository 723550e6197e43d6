"""Wall-clock timing shared by the micro-benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def times_ms(
    fn: Callable[[], object],
    repeats: int,
    setup: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Times in ms (wall by default; `time.process_time` for CPU) of `repeats` runs after one warm-up;
    `setup` runs untimed before each."""
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        t0 = clock()
        fn()
        if i:
            times.append((clock() - t0) * 1e3)
    return times
