"""Runs a test file's `test_triton_*` tests in a subprocess under Triton's CPU interpreter.

Triton reads `TRITON_INTERPRET` when it is imported and the kernels' dispatch reads `KVEVICT_TRITON`,
so on a machine without CUDA the comparisons of Triton kernels with their torch references need a
process of their own with both set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_triton_tests(test_file: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", KVEVICT_TRITON="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        test_file,
        "-k",
        "test_triton_",
    ]
    res = subprocess.run(
        cmd, env=env, cwd=Path(test_file).parent, capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1], res.stdout[-2000:]
