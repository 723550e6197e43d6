"""SGLang's own Triton attention over rows this plugin compressed, on CPU under `TRITON_INTERPRET=1`.

Why: the plugin shortens a request's `req_to_token` row (fewer slots than tokens, `seq_lens` = slots, the
logical position carried by an offset) and every attention backend is supposed to read only
`req_to_token` and `seq_lens`. This turns that into a measurement for SGLang's Triton backend, the paged
attention of AMD and many NVIDIA deployments, with no GPU.

Two modes (both need `TRITON_INTERPRET=1` in the environment; the script re-executes itself with it):

`kernels`: SGLang's real pools (`sgl_kvevict.pools.Pools`), rows compressed by the plugin's compressor
under several policies (ragged lengths, offsets > 0, per-head different tokens in one slot). Then
`kv_indptr`/`kv_indices` are built as `TritonAttnBackend.init_forward_metadata` builds them (cumsum of
`seq_lens`, SGLang's `create_flashinfer_kv_indices_triton` gathering from `req_to_token`), and SGLang's
`decode_attention_fwd` (one new query per request) and `extend_attention_fwd` (a chunk of new tokens
after the compressed row, causal) run on them. Outputs are compared with a float64 reference over the
same compacted K/V and with SGLang's `torch_native` backend (`_run_sdpa_forward_decode/_extend`).

`server`: the real server with `--attention-backend triton` on CPU (interpreted), against a
`torch_native` server, same greedy requests: greedy tokens and per-token logprobs.

    python benchmarks/triton_attention_check.py kernels [--small]
    python benchmarks/triton_attention_check.py server [--new-tokens 6]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_client import ChatIds  # noqa: E402

from sgl_kvevict.tools.oracle import worse  # noqa: E402

OUT_DIR = Path("results/triton-attention")
POLICIES = {
    "streaming": {},
    "snapkv": {"window": 8},
    "lagkv": {"lag": 16},
    "d2o": {"window": 8},
    "h2o": {"window": 8},
}


def _ensure_interpreter() -> None:
    """Re-execute with `TRITON_INTERPRET=1` (it must be set before triton is imported)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


# ---------------------------------------------------------------------------------------------------
# kernels: SGLang's Triton decode / extend kernels over a pool compacted by the plugin
# ---------------------------------------------------------------------------------------------------
def _snapshot_keys(pools: Any, reqs: list, layer: int) -> list:
    kb = pools.kv.get_key_buffer(layer)
    return [kb[pools.r2t.req_to_token[i, : r.kv.kv_committed_len].long()].clone() for i, r in enumerate(reqs)]


def _mixed_slots(orig_k, kb, row) -> tuple[int, int]:
    """(slots whose heads hold different original tokens, slots whose every head matched a token)."""
    import torch

    cur = kb[row.long()]  # [n, H, D]
    n, heads = cur.shape[0], cur.shape[1]
    tok = torch.full((n, heads), -1, dtype=torch.long)
    for h in range(heads):
        eq = (cur[:, h, None, :] == orig_k[None, :, h, :]).all(-1)  # [n, n_orig]
        hit = eq.any(-1)
        tok[hit, h] = eq[hit].float().argmax(-1)
    matched = (tok >= 0).all(-1)
    mixed = matched & (tok != tok[:, :1]).any(-1)
    return int(mixed.sum()), int(matched.sum())


def build_kv_indices(r2t, rows, lens):
    """`kv_indptr`, `kv_indices` exactly as `TritonAttnBackend._fill_kv_indptr_and_indices` builds them
    for a non-translated pool: indptr = cumsum(seq_lens), SGLang's own gather kernel over req_to_token."""
    import torch
    from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton

    bs = rows.numel()
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=r2t.device)
    kv_indptr[1:] = torch.cumsum(lens, dim=0)
    kv_indices = torch.empty(int(lens.sum()), dtype=torch.int64, device=r2t.device)
    create_flashinfer_kv_indices_triton[(bs, 1)](
        r2t,
        rows,
        lens,
        kv_indptr,
        None,
        kv_indices,
        r2t.stride(0),
        ENTRY_PAGE_SIZE=1,
        TOKEN_BLOCK_PARALLEL=False,
    )
    return kv_indptr, kv_indices


def ref_attention(q, k, v, scale, n_prefix: int):
    """float64 attention of queries [E, Hq, D] over k/v [N, Hkv, D]; query j sees keys < n_prefix + j + 1."""
    import torch

    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = torch.einsum("ehd,nhd->hen", q.double(), k) * scale
    e, n = q.shape[0], k.shape[0]
    mask = torch.arange(n, device=q.device)[None, :] > (n_prefix + torch.arange(e, device=q.device))[:, None]
    s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hen,nhd->ehd", s.softmax(-1), v)


def check_kernels(small: bool, dtype_name: str = "bfloat16") -> list[dict]:
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sgl_kvevict.cache import compressor
    from sgl_kvevict.tools.pools import Pools

    dtype = getattr(torch, dtype_name)
    layers, n_reqs, tokens, budget, extend = (1, 2, 96, 24, 3) if small else (2, 3, 160, 48, 6)
    kv_heads, group, head_dim, max_splits = 3, 3, 64, 8  # SmolLM2's heads; SGLang's default kv splits
    policies = {"streaming": {}, "snapkv": {"window": 8}} if small else POLICIES
    native = object.__new__(TorchNativeAttnBackend)
    rows_out = []
    for pi, (policy, cfg) in enumerate(policies.items()):
        t0 = time.time()
        pools = Pools(layers, kv_heads, group, head_dim, n_reqs + 1, tokens + 2 * extend, dtype, seed=pi)
        b = pools.batch(n_reqs, tokens, policy, budget, cfg)
        for i, r in enumerate(b.reqs):  # ragged lengths
            r.kv.kv_committed_len = r.kv.kv_allocated_len = tokens - 9 * i
        orig = [_snapshot_keys(pools, b.reqs, layer) for layer in range(layers)]
        freed = [compressor.safe_compress(r, "decode") for r in b.reqs]
        r2t = pools.r2t.req_to_token
        for i, r in enumerate(b.reqs):  # decode tokens after the compression: ragged slot counts
            kv, grow = r.kv, 5 * i
            if not grow:
                continue
            r2t[i, kv.kv_committed_len : kv.kv_committed_len + grow] = pools.alloc.alloc(grow).to(r2t.dtype)
            kv.kv_committed_len = kv.kv_allocated_len = kv.kv_committed_len + grow
        lens = torch.tensor([r.kv.kv_committed_len for r in b.reqs], dtype=torch.int64)
        rows = torch.arange(n_reqs, dtype=torch.int64)
        offsets = pools.tree.offsets[:n_reqs].tolist()
        logical = [tokens - 4 * i for i in range(n_reqs)]  # 9 fewer prompt tokens, 5 more decoded
        scale = head_dim**-0.5
        g = torch.Generator().manual_seed(100 + pi)
        res: dict[str, Any] = {
            "policy": policy,
            "dtype": dtype_name,
            "logical_tokens": logical,
            "slots": lens.tolist(),
            "offsets": offsets,
            "freed": freed,
        }
        kv_indptr, kv_indices = build_kv_indices(r2t, rows, lens)
        gathered = torch.cat([r2t[i, : int(lens[i])].long() for i in range(n_reqs)])
        res["kv_indices_equal_req_to_token"] = bool(torch.equal(kv_indices, gathered))
        worst = {"decode_vs_ref": 0.0, "decode_vs_native": 0.0, "extend_vs_ref": 0.0, "extend_vs_native": 0.0}
        mixed = matched = 0
        for layer in range(layers):
            kb, vb = pools.kv.get_key_buffer(layer), pools.kv.get_value_buffer(layer)
            for i in range(n_reqs):
                m, a = _mixed_slots(orig[layer][i], kb, r2t[i, : int(lens[i])])
                mixed, matched = mixed + m, matched + a
            # decode: one new query per request against its compressed row
            q = torch.randn(n_reqs, kv_heads * group, head_dim, generator=g).to(dtype)
            o = torch.empty_like(q)
            logits = torch.empty(n_reqs, kv_heads * group, max_splits, head_dim, dtype=torch.float32)
            lse = torch.empty(n_reqs, kv_heads * group, max_splits, dtype=torch.float32)
            splits = torch.full((n_reqs,), max_splits, dtype=torch.int32)  # CPU: no core count, static
            decode_attention_fwd(
                q, kb, vb, o, kv_indptr, kv_indices, logits, lse, splits, max_splits, scale, 1.0, 1.0
            )
            o_nat = torch.empty_like(q)
            native._run_sdpa_forward_decode(
                q, o_nat, kb, vb, r2t, rows, lens, scaling=scale, enable_gqa=True, causal=False
            )
            for i in range(n_reqs):
                row = r2t[i, : int(lens[i])].long()
                ref = ref_attention(q[i : i + 1], kb[row], vb[row], scale, int(lens[i]))
                worst["decode_vs_ref"] = worse(
                    worst["decode_vs_ref"], (o[i : i + 1].double() - ref).abs().max().item()
                )
            worst["decode_vs_native"] = worse(worst["decode_vs_native"], (o - o_nat).abs().max().item())
            # extend: `extend` new tokens after each compressed row (prefix = the row), causal among them
            new = pools.alloc.alloc(n_reqs * extend).view(n_reqs, extend)
            for i in range(n_reqs):
                r2t[i, int(lens[i]) : int(lens[i]) + extend] = new[i].to(r2t.dtype)
            qe = torch.randn(n_reqs * extend, kv_heads * group, head_dim, generator=g).to(dtype)
            ke, ve = kb[new.reshape(-1)].contiguous(), vb[new.reshape(-1)].contiguous()
            oe = torch.empty_like(qe)
            qo_indptr = torch.arange(0, (n_reqs + 1) * extend, extend, dtype=torch.int32)
            extend_attention_fwd(
                qe, ke, ve, oe, kb, vb, qo_indptr, kv_indptr, kv_indices, None, True, None, extend, 1.0, 1.0,
                sm_scale=scale,
            )  # fmt: skip
            oe_nat = torch.empty_like(qe)
            ext = torch.full((n_reqs,), extend, dtype=torch.int64)
            native._run_sdpa_forward_extend(
                qe, oe_nat, kb, vb, r2t, rows, lens + extend, lens, ext, scaling=scale, enable_gqa=True, causal=True
            )  # fmt: skip
            for i in range(n_reqs):
                row = r2t[i, : int(lens[i]) + extend].long()
                sl = slice(i * extend, (i + 1) * extend)
                ref = ref_attention(qe[sl], kb[row], vb[row], scale, int(lens[i]))
                worst["extend_vs_ref"] = worse(
                    worst["extend_vs_ref"], (oe[sl].double() - ref).abs().max().item()
                )
            worst["extend_vs_native"] = worse(worst["extend_vs_native"], (oe - oe_nat).abs().max().item())
            pools.alloc.free(new.reshape(-1))
            for i in range(n_reqs):
                r2t[i, int(lens[i]) : int(lens[i]) + extend] = 0
        res.update({f"max_abs_{k}": v for k, v in worst.items()})
        res["slots_heads_hold_different_tokens"] = mixed
        res["slots_matched"] = matched
        res["seconds"] = round(time.time() - t0, 1)
        rows_out.append(res)
        print(
            f"[kernels] {policy:10s} {dtype_name} slots {res['slots']} of {logical} offsets {offsets} "
            f"mixed-head slots {mixed}/{matched}  decode |o-ref| {worst['decode_vs_ref']:.2e} "
            f"|o-native| {worst['decode_vs_native']:.2e}  extend |o-ref| {worst['extend_vs_ref']:.2e} "
            f"|o-native| {worst['extend_vs_native']:.2e}  ({res['seconds']} s)",
            flush=True,
        )
    return rows_out


# ---------------------------------------------------------------------------------------------------
# server: the real server with --attention-backend triton (interpreted) against torch_native
# ---------------------------------------------------------------------------------------------------
SERVER_POLICIES = {
    "streaming": {},
    "snapkv": {"window": 8},
    "lagkv": {"lag": 16},
    "d2o": {"window": 8},
}


def _prompts() -> tuple[Any, dict[str, list[int]]]:
    from transformers import AutoTokenizer

    from sgl_kvevict.model import default_model_path
    from sgl_kvevict.scenarios.text import log_text

    tok = AutoTokenizer.from_pretrained(default_model_path())

    def chat(msgs: list[dict]) -> list[int]:
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

    prompts = {
        name: chat([{"role": "user", "content": log_text(tok, 100, 40 + i) + "\nWhat happened last?"}])
        for i, name in enumerate(SERVER_POLICIES)
    }
    return (tok, chat), prompts


def _gen(srv: Any, ids: list[int], n: int, kv: dict) -> dict:
    import requests

    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "custom_params": {"kvevict": kv}},
    }
    r = requests.post(srv.url + "/generate", json=body, timeout=7200)
    r.raise_for_status()
    out = r.json()
    meta = out["meta_info"]
    return {
        "ids": out["output_ids"],
        "text": out["text"],
        "logprobs": [x[0] for x in meta["output_token_logprobs"]],
        "kvevict": meta["kvevict"][0],
    }


REQUESTS = ["streaming", "snapkv", "multiturn", "lagkv", "d2o", "none"]
DEFAULT_REQUESTS = REQUESTS[:-1]


def _requests(n: int, budget: int, order: list[str]) -> Iterator[tuple[str, Any]]:
    """The check's requests in order of interest, as (name, fn(server) -> result); the multi-turn's second
    turn reuses the first turn's compressed history from the radix tree."""
    (tok, chat), prompts = _prompts()
    for name in order:
        if name == "none":  # the baseline: SnapKV's prompt with no compression at all
            kv = {"policy": "none"}
            yield name, lambda srv, ids=prompts["snapkv"], kv=kv: _gen(srv, ids, n, kv)
            continue
        if name != "multiturn":
            kv = {"policy": name, "budget": budget, "config": SERVER_POLICIES[name]}
            yield name, lambda srv, ids=prompts[name], kv=kv: _gen(srv, ids, n, kv)
            continue
        msgs = [{"role": "user", "content": tok.decode(prompts["streaming"][:-20]) + " Summarize."}]
        kv = {"policy": "streaming", "budget": budget}

        def two_turns(srv, msgs=msgs, kv=kv):
            # turn 2's ids extend turn 1's prompt and answer token for token, as an agent sends them, so
            # it matches turn 1's compressed node (a re-encoded chat would not); when both servers' turn 1
            # agree, their turn-2 prompts agree
            ids = chat(msgs)
            first = _gen(srv, ids, n, kv)
            ci = ChatIds(tok)
            follow = ci.message("user", FOLLOW_UP[0]["content"]) + ci.gen_prompt
            second = _gen(srv, ids + ci.after_answer(first["ids"]) + follow, n, kv)
            return {**second, "first_turn_ids": first["ids"], "first_turn_logprobs": first["logprobs"]}

        yield name, two_turns


FOLLOW_UP = [{"role": "user", "content": "Which worker appears most in the log?"}]


def _run_server(backend: str, n: int, budget: int, order: list[str], sink: Any) -> None:
    """Every request of the check on one server (`backend` is SGLang's `--attention-backend`); each result
    goes to `sink(name, result)` as it arrives."""
    from sgl_kvevict.serve.serverproc import Server

    env = {"TRITON_INTERPRET": "1"} if backend == "triton" else {"TRITON_INTERPRET": "0"}
    args = ["--attention-backend", backend, "--kv-policy", "streaming", "--kv-budget", str(budget)]
    args += ["--max-total-tokens", "20000", "--max-running-requests", "4"]
    with Server(args, env=env, timeout=3600, log_path=f"/tmp/sgl-kvevict-triton-check-{backend}.log") as srv:
        for name, fn in _requests(n, budget, order):
            t0 = time.time()
            res = fn(srv)
            res["seconds"] = round(time.time() - t0, 1)
            print(f"[server:{backend}] {name}: {res['ids']} {[round(x, 4) for x in res['logprobs']]} "
                  f"({res['seconds']} s)", flush=True)  # fmt: skip
            sink(name, res)


def _compare(name: str, got: dict, ref: dict, n: int) -> dict:
    same = got["ids"] == ref["ids"]
    agree = next((i for i, (a, b) in enumerate(zip(got["ids"], ref["ids"], strict=False)) if a != b), n)
    # logprobs of the same token at the same step: up to and including the first differing step
    diffs = [
        abs(a - b) for a, b in zip(got["logprobs"][: agree + 1], ref["logprobs"][: agree + 1], strict=False)
    ]
    info, ref_info = got["kvevict"], ref["kvevict"]
    row = {
        "request": name,
        "tokens_identical": same,
        "first_difference": None if same else agree,
        "max_abs_logprob_diff": functools.reduce(worse, diffs, 0.0),
        "evicted": info["evicted"],
        "native_evicted": ref_info["evicted"],
        "kv_tokens": info["kv_tokens"],
        "logical_tokens": info["logical_tokens"],
        "reused_evicted": info.get("reused_evicted", 0),
        "compressions": info["compressions"],
        "triton_ids": got["ids"],
        "native_ids": ref["ids"],
        "triton_seconds": got["seconds"],
    }
    if "first_turn_ids" in got:
        row["first_turn_identical"] = got["first_turn_ids"] == ref["first_turn_ids"]
        row["first_turn_max_abs_logprob_diff"] = functools.reduce(
            worse,
            (
                abs(a - b)
                for a, b in zip(got["first_turn_logprobs"], ref["first_turn_logprobs"], strict=False)
            ),
            0.0,
        )
    print(
        f"[server] {name:10s} tokens identical {same}  max |logprob diff| {row['max_abs_logprob_diff']:.4f}  "
        f"evicted {info['evicted']} (native {ref_info['evicted']})  kv {info['kv_tokens']} of "
        f"{info['logical_tokens']} logical  reused-evicted {row['reused_evicted']}",
        flush=True,
    )
    return row


def check_server(n: int, budget: int, order: list[str], out_file: Path) -> list[dict]:
    """Greedy tokens and logprobs of the Triton backend against torch_native, request by request. The
    torch_native server runs beside the (much slower) interpreted one; each comparison is written to
    `out_file` as soon as both sides have it, so a stopped run keeps what it measured."""
    native: dict[str, dict] = {}
    done = threading.Event()

    def run_native() -> None:
        try:
            _run_server("torch_native", n, budget, order, native.__setitem__)
        finally:
            done.set()

    threading.Thread(target=run_native, daemon=True).start()
    rows: list[dict] = []

    def on_triton(name: str, res: dict) -> None:
        while name not in native and not done.is_set():
            time.sleep(1.0)
        if name not in native:
            raise RuntimeError(f"the torch_native server gave no result for {name}")
        rows.append(_compare(name, res, native[name], n))
        out_file.write_text(json.dumps(rows, indent=1) + "\n")

    _run_server("triton", n, budget, order, on_triton)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["kernels", "server"])
    p.add_argument("--small", action="store_true", help="kernels: the suite's short case")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--new-tokens", type=int, default=6, help="server: greedy tokens per request (1-64)")
    p.add_argument("--budget", type=int, default=32, help="server: KV budget in tokens (16-4096)")
    p.add_argument(
        "--requests",
        nargs="+",
        choices=REQUESTS,
        default=DEFAULT_REQUESTS,
        help="server: which requests, in order ('none': SnapKV's prompt uncompressed, the baseline)",
    )
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--json", action="store_true", help="print the results as one JSON line at the end")
    args = p.parse_args(argv)
    if not 1 <= args.new_tokens <= 64:
        p.error("--new-tokens must be in [1, 64]")
    if not 16 <= args.budget <= 4096:
        p.error("--budget must be in [16, 4096]")
    _ensure_interpreter()
    if args.mode == "kernels":
        results: Any = check_kernels(args.small, args.dtype)
        name = f"kernels-{args.dtype}{'-small' if args.small else ''}.json"
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        name = (
            "server.json" if args.requests == DEFAULT_REQUESTS else f"server-{'-'.join(args.requests)}.json"
        )
        results = check_server(args.new_tokens, args.budget, args.requests, args.out / name)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / name).write_text(json.dumps(results, indent=1) + "\n")
    print(f"[triton-attention] wrote {args.out / name}")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
