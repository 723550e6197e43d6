"""The embedded model's HF folder: two servers started at once on a fresh machine both get it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_two_processes_converting_at_once_both_get_the_folder(tmp_path: Path) -> None:
    """Each converts into its own temporary folder; the first rename wins and the other keeps the winner's
    folder (before, both wrote one `.tmp` folder and the loser's save failed, so its server never started)."""
    env = {**os.environ, "KVEVICT_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "sgl_kvevict.model"]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in "ab"
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    paths = {Path(out.strip().splitlines()[-1]) for out, _ in outs}
    assert len(paths) == 1, paths
    (folder,) = paths
    assert (folder / ".complete").exists() and (folder / "config.json").exists()
    assert any(folder.glob("*.safetensors"))
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folder left behind
