"""Two checkouts sharing one venv each import their own code (scripts/env.sh: the shared heavy venv, and a
per-checkout layer `.venv/` holding that checkout's editable install)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = (
    "import importlib.metadata as md, sgl_kvevict, sgl_kvevict.policies, sgl_kvevict.kernels; "
    "ep = [e for e in md.entry_points(group='sglang.srt.plugins') if e.name == 'sgl_kvevict']; "
    "import importlib; plugin = importlib.import_module(ep[0].module); "
    "print(sgl_kvevict.__file__); print(sgl_kvevict.policies.__file__); print(sgl_kvevict.kernels.__file__); "
    "print(plugin.__file__)"
)


def _copy_checkout(dest: Path) -> Path:
    """This checkout's files as git sees them (tracked, and untracked but not ignored), as a fresh tree."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _env(checkout: Path) -> str:
    """`scripts/env.sh` of `checkout`: its python (the shared venv of this machine's KVEVICT_CACHE)."""
    out = subprocess.run(
        ["bash", str(checkout / "scripts/env.sh")], capture_output=True, text=True, env=os.environ.copy()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def _imported(py: str, cwd: Path) -> list[Path]:
    out = subprocess.run([py, "-c", PROBE], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return [Path(line).resolve() for line in out.stdout.split()]


@pytest.mark.slow
def test_two_checkouts_on_one_venv_each_import_their_own_files(tmp_path: Path):
    a = _copy_checkout(tmp_path / "a")
    b = _copy_checkout(tmp_path / "b")
    py_a = _env(a)
    py_b = _env(b)  # b ran env.sh last: before the layers, every checkout then imported b's files
    shared = subprocess.run(
        ["bash", str(a / "scripts/env.sh"), "--shared"], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert py_a != py_b and Path(py_a).is_relative_to(a) and Path(py_b).is_relative_to(b)
    assert not Path(shared).is_relative_to(a) and not Path(shared).is_relative_to(b)
    for checkout, py in ((a, py_a), (b, py_b)):
        for cwd in (checkout, tmp_path):  # inside the checkout and outside it
            files = _imported(py, cwd)
            want = [
                checkout / "sgl_kvevict/__init__.py",
                checkout / "policies/__init__.py",
                checkout / "kernels/__init__.py",
                checkout / "sgl_kvevict/serve/plugin.py",  # the plugin SGLang loads by its entry point
            ]
            assert files == [w.resolve() for w in want], (checkout, cwd, files)
    # the heavy packages come from the one shared venv, not from a copy per checkout
    torch_a = subprocess.run(
        [py_a, "-c", "import torch; print(torch.__file__)"], capture_output=True, text=True
    )
    assert torch_a.returncode == 0 and Path(torch_a.stdout.strip()).is_relative_to(Path(shared).parent.parent)
    # and a make target runs the checkout's own python
    made = subprocess.run(
        ["make", "-s", "-C", str(b), "env"], capture_output=True, text=True, env=os.environ.copy()
    )
    assert made.returncode == 0, made.stderr[-2000:]
    assert _imported(py_a, a)[0] == (a / "sgl_kvevict/__init__.py").resolve()
