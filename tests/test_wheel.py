"""The wheel a GPU user installs: built from this checkout, installed into a fresh venv with no editable
install, it carries the kernels, policies and scenarios and registers the SGLang plugin.

The fresh venv gets no dependencies of its own (the wheel goes in with `--no-deps`): a `.pth` file holds
the plain path of the site-packages that holds torch, pydantic and SGLang, so they import from there. A plain
path line in a `.pth` is appended to `sys.path`, but the `.pth` files inside that directory (this
checkout's editable finder among them) are not processed, so `sgl_kvevict` can only come from the wheel.
No server: about half a minute, most of it building the wheel and the venv.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

CHECK = r"""
import importlib, importlib.metadata as md, json, sys
eps = [(e.name, e.value) for e in md.entry_points(group="sglang.srt.plugins")]
import sgl_kvevict, sgl_kvevict.kernels as K, sgl_kvevict.policies as P, sgl_kvevict.scenarios as S
from sgl_kvevict.serve import plugin
load = dict((e.name, e) for e in md.entry_points(group="sglang.srt.plugins"))["sgl_kvevict"].load()
print(json.dumps({
    "eps": eps,
    "version": md.version("sgl-kvevict"),
    "files": [sgl_kvevict.__file__, K.__file__, P.__file__, S.__file__, plugin.__file__],
    "loaded": f"{load.__module__}:{load.__qualname__}",
    "policies": sorted(P.available()),
    "built": type(P.build("d2o")).__module__,
    "kernel": callable(getattr(K, "compact", None)),
}))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_the_wheel_installs_into_a_clean_venv_and_registers_the_plugin(tmp_path):
    # Built as `make wheel` builds it (scripts/wheel.sh): from a copy of the tracked files the wheel
    # needs, so a file git does not track cannot slip into it, and no stale `build/` is reused.
    dist = tmp_path / "dist"
    built = _run(
        ["bash", str(ROOT / "scripts" / "wheel.sh"), str(dist)], env={**os.environ, "PYTHON": sys.executable}
    )
    assert (
        Path(built.stdout.strip().splitlines()[-1]).name
        == f"sgl_kvevict-{_pyproject_version()}-py3-none-any.whl"
    )
    (wheel,) = dist.glob("sgl_kvevict-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for sub in ("kernels", "policies", "scenarios", "serve", "cache", "cpu_compat"):
        assert f"sgl_kvevict/{sub}/__init__.py" in names, sub
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "results/"))]

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    new_py = venv / "bin" / "python"
    purelib = Path(
        _run([str(new_py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    # the site-packages that holds the dependencies (torch, sglang): the shared venv's, under this
    # checkout's own `.venv/` layer (scripts/env.sh), whose site-packages holds only the editable install
    deps = Path(importlib.util.find_spec("torch").origin).resolve().parents[1]
    (purelib / "zz_project_site.pth").write_text(f"{deps}\n")
    _run([sys.executable, "-m", "pip", "--python", str(new_py), "install", "--no-deps", "-q", str(wheel)])

    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    out = _run([str(new_py), "-c", CHECK], cwd=tmp_path, env=env)
    got = json.loads(out.stdout.strip().splitlines()[-1])

    assert ["sgl_kvevict", "sgl_kvevict.serve.plugin:load"] in got["eps"], got["eps"]
    assert got["loaded"] == "sgl_kvevict.serve.plugin:load"
    for f in got["files"]:  # the package, its kernels, policies, scenarios and plugin: all from the wheel
        assert Path(f).resolve().is_relative_to(venv.resolve()), f
        assert not Path(f).resolve().is_relative_to(ROOT), f
    assert got["kernel"]
    assert {"none", "streaming", "knorm", "h2o", "snapkv", "lagkv", "d2o", "graphkv", "criticalkv"} <= set(
        got["policies"]
    )
    assert got["built"] == "sgl_kvevict.policies.d2o"
    assert got["version"] == _pyproject_version()


def _pyproject_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
