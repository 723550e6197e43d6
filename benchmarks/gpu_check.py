"""One command for a GPU user: does sgl-kvevict behave on *your* GPU? (Never run by the project: it
has no GPU.)

`python benchmarks/gpu_check.py --model-path meta-llama/Llama-3.1-8B-Instruct`

For each attention backend (`flashinfer`, `triton`, and `fa3` on Hopper, SGLang's default there for
Llama-class models) and each policy, it starts the real SGLang server
(with this plugin) and checks:

1. **What the plugin leaves on.** `GET /server_info`: CUDA graphs and the overlap scheduler must both
   be on under every policy (window-query capture is graph-safe, and a compaction is ordered after the
   previous forward on the GPU stream instead of switching overlap off). Each policy runs three times:
   SGLang's defaults, `--disable-cuda-graph`, and `--disable-overlap-schedule`.
2. **Token identity with nothing evicted.** Greedy outputs at budget `100%` must equal `none`'s on the
   same backend, token for token, in all three runs (the step runs, positions and rows go through the
   hooks, nothing is dropped).
3. **Overlap changes nothing.** Greedy outputs at budget `--budget` (compressing), one request at a time,
   must be the same with overlap on and off: a compaction that raced the previous forward (reading K/V
   or window queries it had not written yet) would show up here.
4. **Decode throughput vs `none`**, default flags (graphs and overlap on) at budget `--budget`: output
   tokens per second over `--requests` concurrent requests.

Prints one table and writes it (with the raw numbers) to `--out` as JSON. Exit code 1 if any token
identity or overlap check fails, 2 on bad arguments or without CUDA.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time
from typing import Any

POLICIES = ["streaming", "knorm", "lagkv", "h2o", "snapkv", "d2o", "graphkv", "criticalkv"]
BACKENDS = ["flashinfer", "triton", "fa3"]  # the plugin's CUDA backends (plugin.SUPPORTED_ATTENTION_BACKENDS)
PROMPT = (
    "You are a careful assistant. Summarise the following operations log and then list every error "
    "code it mentions, in order.\n"
)


def _prompts(n: int, words: int) -> list[str]:
    return [PROMPT + " ".join(f"step {i}.{j}: ok" for j in range(words)) for i in range(n)]


# what a server's processes import at start (the HTTP server, the scheduler and its model runner, CUDA
# graphs, the model, the Triton backend, the sampler, the host pools' kernels, this plugin): on a new
# machine `--preflight` imports them here first and lists every module missing, not only the first
PREFLIGHT_MODULES = (
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.models.llama",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.sampler",
    "sglang.srt.mem_cache.memory_pool_host",
    "sgl_kvevict.serve.plugin",
)


def preflight(modules: tuple[str, ...] = PREFLIGHT_MODULES, tries: int = 50) -> list[str]:
    """Import `modules` as a server's processes will on this machine; returns what failed. A missing module
    is recorded and stood in for by a placeholder (`unittest.mock.MagicMock`) so that the import goes on
    to the next missing one: one run lists them all (each try of a server start costs minutes on a GPU).
    Any other error is recorded and ends that module's import."""
    import importlib
    from unittest import mock

    problems: list[str] = []
    for name in modules:
        for _ in range(tries):
            try:
                importlib.import_module(name)
                break
            except ModuleNotFoundError as e:
                if not e.name or e.name in sys.modules:
                    problems.append(f"{name}: ModuleNotFoundError: {e}")
                    break
                problems.append(f"missing module {e.name} (importing {name})")
                sys.modules[e.name] = mock.MagicMock(name=e.name)
            except Exception as e:  # noqa: BLE001 (any import-time failure is a finding)
                problems.append(f"{name}: {type(e).__name__}: {e}")
                break
    return problems


def _generate(url: str, prompts: list[str], max_new: int, policy: str | None, budget: str) -> list[Any]:
    import requests

    def one(p: str) -> Any:
        sp: dict[str, Any] = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
        if policy is not None:
            sp["custom_params"] = {"kvevict": {"policy": policy, "budget": budget}}
        r = requests.post(url + "/generate", json={"text": p, "sampling_params": sp}, timeout=600)
        r.raise_for_status()
        return r.json()

    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, prompts))


def _tokens(out: dict) -> list[int]:
    return out.get("output_ids") or out["meta_info"].get("output_token_ids") or [hash(out["text"])]


def _server_flags(url: str) -> dict[str, Any]:
    import requests

    info = requests.get(url + "/server_info", timeout=30).json()
    return {k: info.get(k) for k in ("disable_cuda_graph", "disable_overlap_schedule", "attention_backend")}


def _kv_state(url: str) -> dict[str, Any]:
    """The plugin's counters and pool state (`/server_info`, first rank)."""
    import requests

    return requests.get(url + "/server_info", timeout=60).json()["internal_states"][0].get("kvevict") or {}


def _leak_free(url: str) -> tuple[bool, dict[str, Any]]:
    """After `/flush_cache`: every KV slot back in the allocator, no per-request state left."""
    import requests

    requests.post(url + "/flush_cache", timeout=120).raise_for_status()
    st = _kv_state(url)
    ok = st.get("available_tokens") == st.get("max_total_tokens") and not st.get("live_request_states")
    return ok, st


def _recall_check(args: argparse.Namespace, base: list[str], policy: str) -> dict[str, Any]:
    """Recall at its defaults (`--kv-recall-tokens 64`): two turns per conversation, the second reusing the
    first's compressed history; entries are demoted and recalled. Under CUDA graphs a decode step's recall
    cannot run inside the replayed forward: it runs after the step instead (`decode_steps`, the in-forward
    recalls, stays 0 there; `recalls` counts both)."""
    from sgl_kvevict.serve.serverproc import Server

    prompts = _prompts(4, 60)
    srv_args = [*base, "--kv-policy", policy, "--kv-budget", args.budget, "--kv-recall-tokens", "64"]
    with Server(srv_args, timeout=1800) as srv:
        first = _generate(srv.url, prompts, args.max_new_tokens, None, args.budget)
        follow = [
            p + o["text"] + "\nWhich error codes did the log mention?"
            for p, o in zip(prompts, first, strict=True)
        ]
        _generate(srv.url, follow, args.max_new_tokens, None, args.budget)
        host = _kv_state(srv.url).get("host", {})
        leak_free, st = _leak_free(srv.url)
        flags = _server_flags(srv.url)
    return {"policy": policy, "graphs": "recall", **flags, "identical": None, "leak_free": leak_free,
            "slots_freed": st.get("slots_freed"), "demoted": host.get("demoted"),
            "recalls": host.get("recalls"), "decode_steps": host.get("decode_steps"),
            "recall_ok": bool(host.get("demoted")) and bool(host.get("recalls"))}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from sgl_kvevict.serve.serverproc import Server

    rows: list[dict[str, Any]] = []
    ident_prompts = _prompts(4, 60)
    tput_prompts = _prompts(args.requests, args.prompt_words)
    failed = False
    for backend in args.backends:
        base = ["--model-path", args.model_path, "--attention-backend", backend, *args.extra]
        with Server([*base, "--kv-policy", "none"], timeout=1800) as srv:
            ref = [_tokens(o) for o in _generate(srv.url, ident_prompts, args.max_new_tokens, None, "100%")]
            t0 = time.perf_counter()
            outs = _generate(srv.url, tput_prompts, args.max_new_tokens, None, "100%")
            none_tps = sum(len(_tokens(o)) for o in outs) / (time.perf_counter() - t0)
            rows.append({"backend": backend, "policy": "none", "graphs": "default", **_server_flags(srv.url),
                         "identical": True, "tok_s": none_tps, "vs_none": 1.0})  # fmt: skip
        for policy in args.policies:
            squeezed: dict[str, list] = {}
            for mode, extra in (
                ("default", []),
                ("no-graph", ["--disable-cuda-graph"]),
                ("no-overlap", ["--disable-overlap-schedule"]),
            ):
                srv_args = [*base, *extra, "--kv-policy", policy, "--kv-budget", args.budget]
                with Server(srv_args, timeout=1800) as srv:
                    got = _generate(srv.url, ident_prompts, args.max_new_tokens, policy, "100%")
                    same = [_tokens(o) for o in got] == ref
                    failed |= not same
                    row = {"backend": backend, "policy": policy, "graphs": mode, **_server_flags(srv.url),
                           "identical": same}  # fmt: skip
                    if mode != "no-graph":  # compressing, one request at a time: overlap must not matter
                        squeezed[mode] = [
                            _tokens(_generate(srv.url, [p], args.max_new_tokens, policy, args.budget)[0])
                            for p in ident_prompts
                        ]
                    if mode == "default":
                        t0 = time.perf_counter()
                        outs = _generate(srv.url, tput_prompts, args.max_new_tokens, policy, args.budget)
                        tps = sum(len(_tokens(o)) for o in outs) / (time.perf_counter() - t0)
                        row.update(tok_s=tps, vs_none=tps / none_tps)
                    if mode == "no-overlap":
                        row["overlap_same"] = squeezed["default"] == squeezed["no-overlap"]
                        failed |= not row["overlap_same"]
                    row["leak_free"], st = _leak_free(srv.url)
                    row["slots_freed"] = st.get("slots_freed")
                    failed |= not row["leak_free"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        if args.recall and args.policies:
            row = {"backend": backend, **_recall_check(args, base, args.policies[0])}
            failed |= not (row["recall_ok"] and row["leak_free"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'backend':<11}{'policy':<12}{'graphs':<9}{'cuda graph':<12}{'overlap':<9}{'identical':<11}"
          f"{'overlap same':>13}{'leak free':>10}{'tok/s':>9}{'vs none':>9}")  # fmt: skip
    for r in rows:
        tps = f"{r['tok_s']:.1f}" if "tok_s" in r else "-"
        vs = f"{r['vs_none']:.2f}" if "vs_none" in r else "-"
        print(f"{r['backend']:<11}{r['policy']:<12}{r['graphs']:<9}{str(not r['disable_cuda_graph']):<12}"
              f"{str(not r['disable_overlap_schedule']):<9}{str(r['identical']):<11}"
              f"{str(r.get('overlap_same', '-')):>13}{str(r.get('leak_free', '-')):>10}{tps:>9}{vs:>9}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="the model to serve (required, except with --preflight)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--backends",
        default=None,
        help=f"default: {','.join(BACKENDS)} (fa3 only on Hopper, compute capability 9.x)",
    )
    ap.add_argument("--budget", default="50%", help="budget for the throughput run (identity runs at 100%%)")
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests for throughput (1-512)")
    ap.add_argument("--prompt-words", type=int, default=400, help="log lines per throughput prompt (1-20000)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="1-4096")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument(
        "--no-recall",
        dest="recall",
        action="store_false",
        help="skip the recall check (the first policy with --kv-recall-tokens 64: no decode-step recall)",
    )
    ap.add_argument(
        "--preflight",
        action="store_true",
        help="only import what a server imports at start, here, and list every module missing (exit 1 if any)",
    )
    ap.add_argument("extra", nargs="*", help="more launch_server flags, after --")
    args = ap.parse_args(argv)
    if args.preflight:
        problems = preflight()
        for p in problems:
            print(f"preflight: {p}", file=sys.stderr)
        print(f"preflight: {len(PREFLIGHT_MODULES)} modules, {len(problems)} problems", file=sys.stderr)
        return 1 if problems else 0
    if not args.model_path:
        print("gpu_check: --model-path is required", file=sys.stderr)
        return 2
    from sgl_kvevict.policies import REGISTRY

    args.policies = [p for p in args.policies.split(",") if p]
    args.backends = [b for b in (args.backends or ",".join(BACKENDS)).split(",") if b]
    bad = [p for p in args.policies if p not in REGISTRY or p == "none"]
    if bad:
        print(f"--policies: unknown {bad}; valid choices: {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    if [b for b in args.backends if b not in BACKENDS]:
        print(f"--backends: valid choices: {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    for name, lo, hi in (("requests", 1, 512), ("prompt_words", 1, 20000), ("max_new_tokens", 1, 4096)):
        if not lo <= getattr(args, name) <= hi:
            print(f"--{name.replace('_', '-')} must be in [{lo}, {hi}]", file=sys.stderr)
            return 2
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here. This check is for a GPU machine (CUDA graphs, overlap, "
            "FlashInfer/Triton/FA3 backends); on a CPU run the test suite instead (`make test`).",
            file=sys.stderr,
        )
        return 2
    if "fa3" in args.backends and torch.cuda.get_device_capability()[0] != 9:
        print("gpu_check: fa3 runs on Hopper (compute capability 9.x) only: left out here", file=sys.stderr)
        args.backends = [b for b in args.backends if b != "fa3"]
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
