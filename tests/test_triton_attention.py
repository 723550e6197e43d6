"""SGLang's Triton attention kernels over rows this plugin compressed, on CPU tensors.

`benchmarks/triton_attention_check.py kernels --small` runs in a subprocess under `TRITON_INTERPRET=1`
(it must be set before triton is imported): SGLang's real pools, rows compressed by streaming and SnapKV
(fewer slots than tokens, offsets > 0, per-head different tokens in one slot), `kv_indices` built by
SGLang's own kernel from `req_to_token`/`seq_lens`, then `decode_attention_fwd` and `extend_attention_fwd`
against a float64 reference and SGLang's torch_native backend over the same compacted K/V.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BF16_TOL = 2e-2  # bf16 output rounding of values of order 1 (one ulp is 2**-8 at 1)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("triton-attention")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [
        sys.executable,
        "benchmarks/triton_attention_check.py",
        "kernels",
        "--small",
        "--json",
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_rows_are_compressed_the_way_the_claim_needs(results: list[dict]) -> None:
    by = {r["policy"]: r for r in results}
    assert set(by) == {"streaming", "snapkv"}
    for r in results:
        assert all(s < n for s, n in zip(r["slots"], r["logical_tokens"], strict=True)), r
        assert all(o > 0 for o in r["offsets"]), r
        assert len(set(r["slots"])) >= 1 and r["kv_indices_equal_req_to_token"], r
    assert by["snapkv"]["slots_heads_hold_different_tokens"] > 0, by["snapkv"]  # per-head selection
    assert by["streaming"]["slots_heads_hold_different_tokens"] == 0, by["streaming"]


def test_triton_decode_and_extend_match_references(results: list[dict]) -> None:
    for r in results:
        for key in ("decode_vs_ref", "decode_vs_native", "extend_vs_ref", "extend_vs_native"):
            assert r[f"max_abs_{key}"] < BF16_TOL, (r["policy"], key, r[f"max_abs_{key}"])


@pytest.mark.parametrize(
    ("interpret", "no_fix", "armed"), [("1", "0", True), ("0", "0", False), ("1", "1", False)]
)
def test_interpreter_dot_fix_is_armed_only_under_the_interpreter(
    interpret: str, no_fix: str, armed: bool
) -> None:
    """The `.pth` hook patches Triton's interpreter in every process under TRITON_INTERPRET=1 (unless
    KVEVICT_NO_INTERP_FIX=1), else never."""
    code = (
        "import triton.runtime.interpreter as i;"
        "from sgl_kvevict.cpu_compat.triton_interp import is_patched;"
        "print(is_patched(i))"
    )
    env = dict(os.environ, TRITON_INTERPRET=interpret, KVEVICT_NO_INTERP_FIX=no_fix)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == str(armed)
