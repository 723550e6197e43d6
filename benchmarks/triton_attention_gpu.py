"""SGLang's own Triton decode and extend attention kernels, compiled for a GPU, over request rows compacted
by the plugin's Triton compaction kernel. No server and no SGLang install: a GPU machine without
SGLang's CUDA build gets SGLang 0.5.23's four kernel files (`--sglang-files`, copied from an install with
`--copy-sglang-files`), loaded under their own module names, with the three SGLang helper modules they
import stubbed: environment flags at SGLang's defaults, the device queries, and the runtime context
(absent, as before a server publishes it).

Why: the claim that the plugin's compressed rows (fewer slots than tokens, a different kept token per
KV head in one slot, ragged lengths) need nothing from an attention backend but `req_to_token` and
`seq_lens`. `triton_attention_check.py` measures it under Triton's CPU interpreter with SGLang's real
pools; this runs the compiled kernels on the device.

Per case: `n` requests of ragged lengths in a bf16 (or fp32) pool; each keeps `budget` tokens per KV
head (4 sinks, 8 recent, the rest random and different per head) and `compact` moves them to the
front of its row; each then grows by 5*i decoded tokens. Checked: every kept entry sits where the
compaction put it (bit for bit), `kv_indices` built by SGLang's own gather kernel equal the rows, and
SGLang's `decode_attention_fwd` (one new query per request) and `extend_attention_fwd` (a causal chunk
after the row) against a float64 reference over each head's kept tokens taken from the pool before the
compaction.

    python benchmarks/triton_attention_gpu.py --copy-sglang-files .gpu/sglang-kernels   # where SGLang is installed
    python benchmarks/triton_attention_gpu.py --sglang-files .gpu/sglang-kernels --out results/triton-attention-gpu
    TRITON_INTERPRET=1 python benchmarks/triton_attention_gpu.py --device cpu --dtype float32 ...  # a dry run on CPU

Exit code 1 if a check fails; 2 without CUDA (unless `--device cpu` under the interpreter).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import torch
from triton_attention_check import build_kv_indices, ref_attention  # benchmarks/ is on sys.path

from sgl_kvevict import kernels as K

KERNEL_FILES = ("score_mod", "kv_indices", "decode_attention", "extend_attention")  # load order
ATTN = "sglang.kernels.ops.attention"
HKV, GROUP, DIM = 3, 3, 64  # SmolLM2-135M's heads
MAX_SPLITS = 8  # SGLang's default KV splits of a decode


def copy_kernel_files(dest: Path) -> None:
    """The four files of the installed SGLang, for a machine that has none."""
    import sglang.kernels.ops.attention as attn

    dest.mkdir(parents=True, exist_ok=True)
    for name in KERNEL_FILES:
        shutil.copy(Path(attn.__file__).parent / f"{name}.py", dest / f"{name}.py")
    print(f"copied {', '.join(KERNEL_FILES)} to {dest}")


class _Flag:
    """One of SGLang's environment flags, at its default."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def load_kernels(files: Path) -> dict[str, types.ModuleType]:
    """SGLang's kernel files from `files`, under their module names, with stubbed helpers."""
    for pkg in ("sglang", "sglang.kernels", "sglang.kernels.ops", ATTN, "sglang.srt"):
        _stub(pkg, __path__=[])
    flags = {  # sglang/srt/environ.py defaults (0.5.23) of the flags these files read
        "SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS": False,
        "SGLANG_FORCE_LEAN_GRID_CU_MULT": 1.0,
        "SGLANG_TRITON_COMPACT_EXTEND_ATTENTION": True,
        "SGLANG_MLA_DECODE_TUNE": False,
        "SGLANG_TRITON_FP8_PREFILL_ATTN": True,
    }
    _stub("sglang.srt.environ", envs=types.SimpleNamespace(**{k: _Flag(v) for k, v in flags.items()}))

    def cores(device_id: int = 0) -> int:
        return (
            torch.cuda.get_device_properties(device_id).multi_processor_count
            if torch.cuda.is_available()
            else 0
        )

    _stub(
        "sglang.srt.utils",
        is_hip=lambda: torch.version.hip is not None,
        is_cuda=lambda: torch.cuda.is_available() and torch.version.cuda is not None,
        is_gfx95_supported=lambda: False,
        is_gfx1250_supported=lambda: False,
        get_device_core_count=cores,
    )

    def no_context() -> Any:
        raise ValueError("no server runtime context")

    _stub("sglang.srt.runtime_context", get_exec=no_context)
    mods = {}
    for name in KERNEL_FILES:
        spec = importlib.util.spec_from_file_location(f"{ATTN}.{name}", files / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods


def run_case(
    mods: dict, device: str, dtype: torch.dtype, n_reqs: int, tokens: int, budget: int, seed: int
) -> dict:
    g = torch.Generator().manual_seed(seed)
    extend, hq, scale = 6, HKV * GROUP, DIM**-0.5
    pool = n_reqs * (tokens + 5 * n_reqs + extend) + 1
    kb = torch.randn(pool, HKV, DIM, generator=g).to(dtype).to(device)
    vb = torch.randn(pool, HKV, DIM, generator=g).to(dtype).to(device)
    free = (torch.randperm(pool - 1, generator=g) + 1).tolist()  # slot 0 stays unused, as in SGLang
    r2t = torch.zeros(n_reqs, tokens + 5 * n_reqs + extend, dtype=torch.int32, device=device)
    kept_k, kept_v, lens = [], [], []
    compaction_ok = True
    for i in range(n_reqs):
        n = tokens - 9 * i  # ragged prompts
        row = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int64, device=device)
        r2t[i, :n] = row.to(torch.int32)
        middle = torch.stack([torch.randperm(n - 12, generator=g)[: budget - 12] + 4 for _ in range(HKV)])
        ends = torch.cat([torch.arange(4), torch.arange(n - 8, n)]).expand(HKV, 12)
        keep = torch.cat([ends, middle], 1).sort(1).values.to(device)  # [Hkv, b]: per head its own tokens
        heads = torch.arange(HKV, device=device)[:, None]
        want_k, want_v = kb[row[keep], heads], vb[row[keep], heads]  # [Hkv, b, D] before the compaction
        K.compact([kb], [vb], row, keep[None])  # the plugin's kernel: kept entries to the row's front
        compaction_ok &= bool(torch.equal(kb[row[:budget]].transpose(0, 1), want_k))
        compaction_ok &= bool(torch.equal(vb[row[:budget]].transpose(0, 1), want_v))
        free.extend(row[budget:].tolist())  # the row's tail goes back to the pool
        grow = torch.tensor([free.pop(0) for _ in range(5 * i)], dtype=torch.int64, device=device)
        r2t[i, budget : budget + 5 * i] = grow.to(torch.int32)  # decoded after the compaction
        kept_k.append(torch.cat([want_k.transpose(0, 1), kb[grow]]))
        kept_v.append(torch.cat([want_v.transpose(0, 1), vb[grow]]))
        lens.append(budget + 5 * i)
    seq = torch.tensor(lens, dtype=torch.int64, device=device)
    rows = torch.arange(n_reqs, dtype=torch.int64, device=device)
    indptr, indices = build_kv_indices(r2t, rows, seq)  # SGLang's gather kernel, loaded above
    gathered = torch.cat([r2t[i, : lens[i]].long() for i in range(n_reqs)])
    res: dict[str, Any] = {
        "requests": n_reqs,
        "logical_tokens": [tokens - 9 * i + 5 * i for i in range(n_reqs)],
    }
    res.update(
        slots=lens, compaction_exact=compaction_ok, kv_indices_equal_rows=bool(torch.equal(indices, gathered))
    )

    q = torch.randn(n_reqs, hq, DIM, generator=g).to(dtype).to(device)
    o = torch.empty_like(q)
    logits = torch.empty(n_reqs, hq, MAX_SPLITS, DIM, dtype=torch.float32, device=device)
    lse = torch.empty(n_reqs, hq, MAX_SPLITS, dtype=torch.float32, device=device)
    splits = torch.full((n_reqs,), MAX_SPLITS, dtype=torch.int32, device=device)
    mods["decode_attention"].decode_attention_fwd(
        q, kb, vb, o, indptr, indices, logits, lse, splits, MAX_SPLITS, scale, 1.0, 1.0
    )
    res["max_abs_decode_vs_ref"] = max(
        (o[i : i + 1].double() - ref_attention(q[i : i + 1], kept_k[i], kept_v[i], scale, lens[i]))
        .abs()
        .max()
        .item()
        for i in range(n_reqs)
    )

    new = torch.tensor([free.pop() for _ in range(n_reqs * extend)], device=device).view(n_reqs, extend)
    for i in range(n_reqs):
        r2t[i, lens[i] : lens[i] + extend] = new[i].to(torch.int32)
    qe = torch.randn(n_reqs * extend, hq, DIM, generator=g).to(dtype).to(device)
    ke, ve = kb[new.reshape(-1)].contiguous(), vb[new.reshape(-1)].contiguous()
    oe = torch.empty_like(qe)
    qo_indptr = torch.arange(0, (n_reqs + 1) * extend, extend, dtype=torch.int32, device=device)
    mods["extend_attention"].extend_attention_fwd(
        qe, ke, ve, oe, kb, vb, qo_indptr, indptr, indices, None, True, None, extend, 1.0, 1.0, sm_scale=scale
    )
    worst = 0.0
    for i in range(n_reqs):
        sl = slice(i * extend, (i + 1) * extend)
        k_all, v_all = torch.cat([kept_k[i], ke[sl]]), torch.cat([kept_v[i], ve[sl]])
        worst = max(
            worst, (oe[sl].double() - ref_attention(qe[sl], k_all, v_all, scale, lens[i])).abs().max().item()
        )
    res["max_abs_extend_vs_ref"] = worst
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-files", type=Path, default=None, help="folder with SGLang's four kernel files")
    ap.add_argument(
        "--copy-sglang-files", type=Path, default=None, help="copy them from this install, then exit"
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = ap.parse_args()
    if args.copy_sglang_files is not None:
        copy_kernel_files(args.copy_sglang_files)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device is visible (a dry run on CPU: --device cpu with TRITON_INTERPRET=1)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu needs TRITON_INTERPRET=1")
    if args.sglang_files is not None:
        mods = load_kernels(args.sglang_files)
    else:
        mods = {n: importlib.import_module(f"{ATTN}.{n}") for n in KERNEL_FILES}
    dtype = getattr(torch, args.dtype)
    # bf16: a few output ulps. fp32: SGLang's kernels call tl.dot at Triton's default input precision,
    # TF32 on sm_80 and newer (about 1e-3 here), IEEE under the interpreter.
    tol = 2e-2 if dtype == torch.bfloat16 else (5e-3 if args.device == "cuda" else 1e-4)
    cases = (
        [(2, 96, 24), (3, 160, 48)]
        if args.device == "cpu"
        else [(3, 160, 48), (8, 2048, 256), (16, 8192, 1024)]
    )
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    print(f"{where}, torch {torch.__version__}, dtype {args.dtype}, Hq {HKV * GROUP}, Hkv {HKV}, D {DIM}")
    results, ok = [], True
    for seed, (n, tokens, budget) in enumerate(cases):
        res = run_case(mods, args.device, dtype, n, tokens, budget, seed)
        good = (
            res["compaction_exact"]
            and res["kv_indices_equal_rows"]
            and res["max_abs_decode_vs_ref"] < tol
            and res["max_abs_extend_vs_ref"] < tol
        )
        ok &= good
        res["ok"] = good
        results.append(res)
        print(
            f"{n} requests, {tokens} tokens -> {budget} kept per head: compaction exact {res['compaction_exact']}, "
            f"kv_indices == rows {res['kv_indices_equal_rows']}, decode |o-ref| {res['max_abs_decode_vs_ref']:.2e}, "
            f"extend |o-ref| {res['max_abs_extend_vs_ref']:.2e} (tolerance {tol:g}): {'ok' if good else 'FAILED'}",
            flush=True,
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "device": where,
            "torch": torch.__version__,
            "dtype": args.dtype,
            "sglang_files": str(args.sglang_files),
        }
        (args.out / f"results-{args.dtype}.json").write_text(
            json.dumps({"meta": meta, "cases": results}, indent=1)
        )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
