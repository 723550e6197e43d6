"""`benchmarks/recall_cost.py` (the cost of recall on SGLang's real pools, no model) runs end to end: it
broke once when a hook's signature changed and nothing ran it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_recall_cost_prints_a_row_per_host_size() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "recall_cost.py"), "--host", "256", "--steps", "2"]
    cmd += ["--budget", "64", "--new-tokens", "8", "--min-score", "0.05"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 1, out.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert int(cells[0].replace(",", "")) > 0  # host entries the request held
    assert int(cells[4].replace(",", "")) > 0  # entries the turn's append brought back
    assert float(cells[7]) > 0 and float(cells[8]) > 0  # a decode step timed, in both forms on a CPU
