"""Runs a test file's Triton cases (`triton` marker) in a subprocess under Triton's CPU interpreter.

Triton reads `TRITON_INTERPRET` when it is imported and the kernels' dispatch reads `KVEVICT_TRITON`,
so on a machine without CUDA the comparisons of Triton kernels with their torch references need a
process of their own with both set. The parent deselects those cases (`conftest.py`); the subprocess
runs every one of them that `marks` selects (no `-x`: every failure is reported) and must pass exactly as
many as it selected. `make test` runs the cases without the `long` marker (a representative grid), `make
test-long` the `long` ones (the rest of each grid): between them, every case."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def run_triton_tests(test_file: str, marks: str = "triton and not long") -> int:
    env = dict(os.environ, TRITON_INTERPRET="1", KVEVICT_TRITON="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        test_file,
        "-m",
        marks,
    ]
    res = subprocess.run(
        cmd, env=env, cwd=Path(test_file).parent, capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    collected = re.search(r"collected (\d+) items?(?: / (\d+) deselected)?(?: / (\d+) selected)?", res.stdout)
    assert collected, res.stdout[:2000]
    total, deselected, selected = (int(g) if g else None for g in collected.groups())
    want = selected if selected is not None else total - (deselected or 0)
    last = res.stdout.strip().splitlines()[-1]
    counts = {
        word.rstrip("s"): int(n) for n, word in re.findall(r"(\d+) (passed|deselected|warnings?|\w+)\b", last)
    }
    assert want > 0 and counts.get("passed") == want, (want, last)
    assert set(counts) <= {"passed", "deselected", "warning"}, last  # nothing skipped, failed or in error
    return want
