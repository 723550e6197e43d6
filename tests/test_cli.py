"""Bad server flags fail at start, before the model is loaded, with a one-line message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sgl_kvevict.launch import CPU_FLAGS

MISSING_MODEL = "/nonexistent/model-that-would-fail-to-load"


def launch(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", MISSING_MODEL, *args]
    for flag, val in CPU_FLAGS.items():
        cmd += [flag] if val is None else [flag, val]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--kv-policy", "bogus"], ["--kv-policy", "invalid choice", "lagkv", "d2o"]),
        (["--kv-policy", "lagkv", "--kv-budget", "1.5"], ["--kv-budget", "out of range"]),
        (["--kv-policy", "lagkv", "--kv-budget", "0"], ["--kv-budget", "out of range"]),
        (["--kv-policy", "lagkv", "--kv-policy-config", "{lag: 3"], ["--kv-policy-config", "not valid JSON"]),
        (["--kv-policy", "lagkv", "--kv-policy-config", '{"lag": -1}'], ["--kv-policy-config", "'lag'"]),
        (["--kv-policy", "lagkv", "--kv-policy-config", '{"colour": 1}'], ["--kv-policy-config", "'colour'"]),
        (
            ["--kv-policy", "criticalkv", "--kv-policy-config", '{"base": "lagkv"}'],
            ["--kv-policy-config", "lagkv"],
        ),
        (
            ["--kv-policy", "graphkv", "--kv-policy-config", '{"base": "nope"}'],
            ["--kv-policy-config", "nope"],
        ),
        (["--kv-policy", "lagkv", "--page-size", "16"], ["--page-size 1"]),
    ],
)
def test_bad_flags_exit_before_model_load(args, needles):
    res = launch(*args)
    assert res.returncode != 0
    err = res.stderr
    for needle in needles:
        assert needle in err, f"{needle!r} not in stderr:\n{err[-2000:]}"
    # Had the flags passed, SGLang would have tried (and failed) to load the missing model.
    assert MISSING_MODEL not in err.split("error:")[-1]
    assert "Load weight" not in res.stdout + err
