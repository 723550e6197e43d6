"""What recall costs per turn and per decode step as a branch's host history grows: the real recall path
on SGLang's real pools (`sgl_kvevict.tools.pools.Pools`, SmolLM2-135M's shapes: 30 layers, 3 KV heads, 9
query heads, head dim 64, bf16), no model.

    python benchmarks/recall_cost.py --host 2048,8192,32768

For each host size E: one request whose region of E + budget tokens is compressed to the budget (the
evicted E entries per layer and head are demoted to the host tier), then
- a prefill of `--new-tokens` tokens over both tiers (`exact_prefill.attend_row` at every layer: the new
  tokens' queries over the E host entries and the row);
- the turn's append (`recall.append`): a window of 32 queries brings R entries per layer and head back
  into appended slots, picked among the pages their key summaries rank best;
- `--steps` decode steps recall, one query each (`recall_core.step_swaps` pages per step): the
  scheduler's plan (`recall.plan_step`), the fixed-shape exchange at every layer, the records read back
  (`recall.finish_step`). A decode step scores every host key of the branch. On a CPU each layer is one
  compiled loop (`kernels/recall_layer_cpu.py`); `--steps` more steps time the torch form of a layer
  beside it (`KVEVICT_RECALL_KERNEL=torch`, the form a CUDA graph captures).
The score floor is 0 unless `--min-score` says otherwise (the most a recall moves; the random queries here
are no evidence for the floor). Printed per host size: seconds per prefill over both tiers (all layers)
and the host bytes it reads, then per append and per decode step (all layers) the entries recalled, the
bytes moved (K and V, both directions) and the host key bytes read to score. On a GPU the host entries
would be read over PCIe (pinned memory); here both tiers are in RAM, so the bytes are the measure and the
seconds are this CPU's only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sgl_kvevict.cache import capture, compressor, threads  # noqa: E402
from sgl_kvevict.cache import state as st  # noqa: E402
from sgl_kvevict.cache.host_tier import (  # noqa: E402
    decode_recall,
    demote,
    exact_prefill,
    host,
    recall,
    recall_core,
)
from sgl_kvevict.config import SETTINGS_ENV_VAR, RecallTuning, ServerSettings  # noqa: E402
from sgl_kvevict.tools.pools import Pools  # noqa: E402

LAYERS, KV_HEADS, GROUP, DIM = 30, 3, 3, 64
WINDOW = 32  # the append's window queries


class _ForwardBatch(SimpleNamespace):
    """A namespace the recall hook can hold weakly (it keys a forward's rows by the batch)."""


def forward_batch(p: Pools, decode: bool, n_new: int) -> SimpleNamespace:
    """The fields of SGLang's ForwardBatch that `recall.before_attention` reads in a decode step, for row
    0 of `p`."""
    mode = SimpleNamespace(is_decode=lambda: decode, is_extend=lambda: not decode)
    return _ForwardBatch(
        forward_mode=mode,
        req_pool_indices=torch.tensor([0]),
        extend_seq_lens_cpu=None if decode else [n_new],
        req_to_token_pool=p.r2t,  # names the server (`context.of_forward`)
    )


def run_layers(p: Pools, fb: SimpleNamespace, n_q: int) -> float:
    """One forward's recall: the hook at every layer with random queries; seconds."""
    qs = torch.randn(LAYERS, n_q, p.q_heads * DIM, generator=p.gen).to(torch.bfloat16)
    t0 = time.perf_counter()
    for layer in range(LAYERS):
        recall.before_attention(SimpleNamespace(layer_id=layer), qs[layer], None, None, fb)
    return time.perf_counter() - t0


def measure(e: int, budget: int, r: int, new_tokens: int, steps: int) -> dict:
    p = Pools(
        layers=LAYERS, kv_heads=KV_HEADS, group=GROUP, head_dim=DIM, max_reqs=2, max_len=e + budget + 256
    )
    demote.attach(p.ctx, host.HostPool(LAYERS, KV_HEADS, DIM, e + 64, torch.bfloat16))
    batch = p.batch(1, e + budget, "streaming", budget)
    req = batch.reqs[0]
    s = st.get(req)
    s.recall.tokens = r
    with threads.one_thread():
        compressor.compress(req, "prefill")
    assert s.recall.host is not None and s.recall.host.count >= e - 64, (
        s.recall.host.count if s.recall.host else 0,
        e,
    )
    # a new turn's prefill over both tiers: the row's last `new_tokens` slots stand for its new tokens
    kv_len = int(req.kv.kv_committed_len)
    slots = p.r2t.req_to_token[0, :kv_len].to(torch.int64)
    one = exact_prefill.ExactArm(req, s, s.recall.host.cols.clone(), s.recall.host)
    q = torch.randn(new_tokens, p.q_heads, DIM, generator=p.gen).to(torch.bfloat16)
    t0 = time.perf_counter()
    for layer in range(LAYERS):
        exact_prefill.attend_row(one, layer, q, slots, DIM**-0.5)
    prefill_s = time.perf_counter() - t0
    prefill_read = int(one.cols.numel()) * 2 * KV_HEADS * DIM * p.ctx.host.k.element_size() * LAYERS
    # the turn's append, with a captured window of random queries at the row's last positions
    moved0, in0, read0 = s.recall.bytes_moved, s.recall.recalled, p.ctx.host.totals.keys_read
    assert capture.ensure(p.ctx, 0, WINDOW, 0)
    length = s.slot_map.tokens_for(int(req.kv.kv_committed_len))
    for layer in range(LAYERS):
        q = torch.randn(WINDOW, p.q_heads, DIM, generator=p.gen).to(torch.bfloat16)
        p.store.put(0, layer, q, torch.arange(length - WINDOW, length))
    t0 = time.perf_counter()
    assert recall.append(req, s) > 0, "nothing appended"
    append_s = time.perf_counter() - t0
    append = (s.recall.recalled - in0, s.recall.bytes_moved - moved0, p.ctx.host.totals.keys_read - read0)
    step_s, step_in, step_bytes, step_read = [], [], [], []
    torch_s: list[float] = []  # the same steps with the torch form of a layer (KVEVICT_RECALL_KERNEL=torch)
    for form in ("", "torch") if decode_recall.fused_on_cpu(p.kv.get_key_buffer(0)) else ("",):
        os.environ["KVEVICT_RECALL_KERNEL"] = form
        for _ in range(steps):
            moved0, in0, read0 = s.recall.bytes_moved, s.recall.recalled, p.ctx.host.totals.keys_read
            recall.after_compress(req, decode=True)  # due every step: armed for this step's forward
            t0 = time.perf_counter()
            recall.plan_step(p.ctx, [req])  # the scheduler's part before the forward
            if p.ctx.step_plan is None:
                break
            run_layers(p, forward_batch(p, True, 1), 1)
            recall.finish_step(p.ctx)  # and after it
            if form:
                torch_s.append(time.perf_counter() - t0)
                continue
            step_s.append(time.perf_counter() - t0)
            step_in.append(s.recall.recalled - in0)
            step_bytes.append(s.recall.bytes_moved - moved0)
            step_read.append(p.ctx.host.totals.keys_read - read0)
    os.environ.pop("KVEVICT_RECALL_KERNEL", None)
    s.recall.drop_host(s.ctx.host)
    p.ctx.decode_armed.clear()
    return {
        "host": s.recall.host_peak,
        "prefill_s": prefill_s,
        "prefill_read": prefill_read,
        "append_s": append_s,
        "append_in": append[0],
        "append_bytes": append[1],
        "append_read": append[2],
        "step_s": statistics.median(step_s) if step_s else float("nan"),
        "torch_s": statistics.median(torch_s) if torch_s else float("nan"),
        "step_in": statistics.mean(step_in) if step_in else 0,
        "step_bytes": statistics.mean(step_bytes) if step_bytes else 0,
        "step_read": statistics.mean(step_read) if step_read else 0,
        "steps": len(step_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--host", default="2048,8192,32768", help="host history sizes (entries per layer and head)"
    )
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--recall", type=int, default=64, help="R, per layer and KV head")
    ap.add_argument("--page", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64, help="a turn's new tokens (its prefill's queries)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per size")
    ap.add_argument("--min-score", type=float, default=0.0, help="the score floor (the server's: 0.05)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    recall_core.MIN_SCORE = args.min_score
    print(
        "| host entries per layer and head | prefill over both tiers s (all layers) | host bytes read "
        "| append s | entries appended | bytes moved | host keys read "
        "| decode step recall s (median, all layers) | the same, torch form | entries in per step "
        "| bytes moved per step | host keys read per step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    tuning = RecallTuning(page=args.page, every=1)
    os.environ[SETTINGS_ENV_VAR] = ServerSettings(recall_tokens=args.recall, recall=tuning).to_env()
    for e in (int(x) for x in args.host.split(",")):
        print(f"[recall_cost] host {e} ...", file=sys.stderr, flush=True)
        m = measure(e, args.budget, args.recall, args.new_tokens, args.steps)
        print(
            f"| {m['host']:,} | {m['prefill_s']:.3f} | {m['prefill_read'] / 1e6:.2f} MB "
            f"| {m['append_s']:.3f} | {m['append_in']:,} | {m['append_bytes'] / 1e6:.2f} MB "
            f"| {m['append_read'] / 1e6:.2f} MB | {m['step_s']:.4f} | {m['torch_s']:.4f} "
            f"| {m['step_in']:.0f} | {m['step_bytes'] / 1e3:.1f} KB | {m['step_read'] / 1e3:.1f} KB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
