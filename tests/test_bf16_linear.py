"""The bf16 linear layers formed in fp64 on CPUs without bf16 instructions (`cpu_compat/bf16_linear.py`).

Pure tensor math: the product against a float64 reference, and which inputs the hook leaves to SGLang.
That the servers of the suite run with it (or not, on a CPU with native bf16) is what every e2e test
covers; `test_the_hook_is_registered_where_the_cpu_lacks_bf16` checks the registration itself.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from sgl_kvevict.cpu_compat import bf16_linear


def _operands(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 576, generator=g).bfloat16()
    w = (torch.randn(1536, 576, generator=g) / 24).bfloat16()
    b = torch.randn(1536, generator=g).bfloat16()
    return x, w, b


@pytest.mark.parametrize("n", [1, 2, 37, 512])
def test_product_is_the_exact_one_rounded_to_bf16(n: int) -> None:
    x, w, b = _operands(n)
    out = bf16_linear.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), b.double())
    assert out.dtype == torch.bfloat16 and out.shape == (n, 1536)
    # fp64 sums of exact products, then one bf16 rounding: within half a bf16 ulp of exact
    err = (out.double() - exact).abs()
    assert bool((err <= exact.abs() * 2**-8 + 1e-30).all()), float(err.max())
    # and as close to exact as torch's own bf16 GEMM
    ref_err = (F.linear(x, w, b).double() - exact).abs().mean()
    assert float(err.mean()) <= float(ref_err) * 1.05 + 1e-6


def test_a_row_does_not_depend_on_the_rows_beside_it() -> None:
    """Batch invariance: the suite compares tokens computed in batches of different shapes."""
    x, w, b = _operands(300, seed=1)
    full = bf16_linear.linear(x, w, b)
    for m in (1, 2, 7, 64, 128, 299):
        assert torch.equal(bf16_linear.linear(x[:m], w, b), full[:m]), m
        assert torch.equal(bf16_linear.linear(x[-m:], w, b), full[-m:]), m


def test_hook_leaves_other_dtypes_and_extra_arguments_to_sglang() -> None:
    calls: list[str] = []

    def original(method, layer, x, bias=None, *args, **kwargs):
        calls.append(str(x.dtype))
        return F.linear(x, layer.weight, bias)

    layer = torch.nn.Linear(576, 1536, bias=False)
    x32 = torch.randn(3, 576)
    out = bf16_linear.apply(original, None, layer, x32)
    assert calls == ["torch.float32"] and out.dtype == torch.float32
    layer16 = layer.bfloat16()
    x16 = x32.bfloat16()
    out16 = bf16_linear.apply(original, None, layer16, x16)
    assert calls == ["torch.float32"], "a bf16 CPU input must not reach the original"
    assert out16.dtype == torch.bfloat16
    assert torch.equal(out16, bf16_linear.linear(x16, layer16.weight, None))
    bf16_linear.apply(original, None, layer16, x16, None, "extra")
    assert calls[-1] == "torch.bfloat16", "an unknown extra argument goes to SGLang's own apply"


def test_the_hook_is_registered_where_the_cpu_lacks_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_kvevict.serve import plugin

    monkeypatch.delenv(bf16_linear.ENV, raising=False)
    before = [h for _, h, _ in HookRegistry._hooks.get(bf16_linear.TARGET, [])]
    plugin.load()  # a stock server: no stand-in of ours
    hooks = [h for _, h, _ in HookRegistry._hooks.get(bf16_linear.TARGET, [])]
    assert not bf16_linear.enabled() and hooks.count(bf16_linear.apply) == before.count(bf16_linear.apply)
    monkeypatch.setenv(bf16_linear.ENV, "fp64")  # the launcher's switch on CPU
    assert bf16_linear.enabled() == (not bf16_linear.native_bf16())
    plugin.load()
    hooks = [h for _, h, _ in HookRegistry._hooks.get(bf16_linear.TARGET, [])]
    assert (bf16_linear.apply in hooks) == (not bf16_linear.native_bf16())
    monkeypatch.setenv(bf16_linear.ENV, "native")
    assert bf16_linear.native_bf16() and not bf16_linear.enabled()


def test_the_launcher_turns_the_cpu_compatibility_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_kvevict.launch import build_command

    monkeypatch.delenv(bf16_linear.ENV, raising=False)
    assert build_command(["--model-path", "x"], cuda=False)[1][bf16_linear.ENV] == "fp64"
    assert bf16_linear.ENV not in build_command(["--model-path", "x"], cuda=True)[1]
    monkeypatch.setenv(bf16_linear.ENV, "native")  # the user's own choice wins
    assert bf16_linear.ENV not in build_command(["--model-path", "x"], cuda=False)[1]


def test_a_torch_that_cannot_tell_leaves_the_products_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVEVICT_BF16_LINEAR", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert bf16_linear.native_bf16()


def test_fp64_weights_are_kept_refreshed_on_write_and_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = _operands(4, seed=2)
    first = bf16_linear.wide(w)
    assert bf16_linear.wide(w) is first, "a kept copy is reused"
    w.mul_(2)  # an in-place weight update moves the version counter
    again = bf16_linear.wide(w)
    assert again is not first and torch.equal(again, w.double())
    assert torch.equal(bf16_linear.linear(x, w, b), F.linear(x.double(), w.double(), b.double()).bfloat16())
    monkeypatch.setattr(bf16_linear, "CACHE_BYTES", 0)
    other = (torch.randn(8, 576) / 24).bfloat16()
    assert bf16_linear.wide(other) is not bf16_linear.wide(other), "past the cap: converted per call"
    assert id(other) not in bf16_linear.WIDE.copies
    assert bf16_linear.WIDE.kept_bytes == sum(c.nbytes for _, _, c in bf16_linear.WIDE.copies.values())
    kept = bf16_linear.WIDE.kept_bytes
    del w, first, again
    gc.collect()
    assert bf16_linear.WIDE.kept_bytes == kept - 1536 * 576 * 8, "a dead weight's copy leaves the count"
