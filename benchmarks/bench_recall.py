"""Page-level recall from the host tier: which page summary finds the entries a turn needs, and what a turn
of page scoring + selection + swap costs against scoring every host key.

(1) Quality, real KV (SmolLM2-135M-Instruct, HF transformers, fp32, CPU). An agent session from
`scenarios/agent.py` (tool outputs: logs, JSON rows, file listings, search results) is flattened to text,
cut to --tokens, and ends with a new user question; one prefill gives every layer's post-RoPE keys and
the last W=32 post-RoPE queries. Host entries = every column but the 4 sinks and the window itself. The
truth per layer and KV head: the top-R host entries by exact causal window attention (the score the
policies use: softmax per query over all tokens, mean over the W queries and the G query heads). Each
method scores pages of `page` columns and selects R/page pages per head (fetched columns = R), and
the table reports the fraction of the true top-R inside the selected pages (mean over layers, heads and
texts) and the attention mass they hold relative to the true top-R's. "fetch 2R" selects 2R/page pages,
then keeps the best R of the fetched columns by their exact score (what a tier does once the columns are
on the device). Methods: minmax (Quest bound) and mean key, each aggregated by max or sum over the
window queries and the group; "oracle" ranks pages by their true attention mass (the best any page
summary can do); "recent" takes the newest pages.

(2) Cost, synthetic tensors at the model's shape (30 layers, Hq=9, Hkv=3, D=64, bf16, W=32), per turn over
all layers, at 2K, 8K and 32K host columns: "flat" = window attention over every host key, top-R, swap;
"pages" = page scores (minmax or mean), select 2R/page pages, gather their K, exact scores, top-R, swap.
Torch references on this CPU, one thread; CPU seconds (process time) per turn, median of the repeats.
Bytes: what each turn reads from the host store (K for scoring or candidates, K+V swapped in), writes
back to it (K+V swapped out), and reads from device-resident summaries. No GPU here: the Triton kernels
are not timed.

    HF_HUB_OFFLINE=1 python benchmarks/bench_recall.py --out results/recall-pages

Options: --tokens (default 4096), --texts (agent sessions, default 2), --skip-quality, --skip-cost,
--recall (R for the cost part, default 256), --cost-page (default 32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from timing import times_ms  # benchmarks/timing.py (scripts run with benchmarks/ on sys.path)

from sgl_kvevict import kernels as K
from sgl_kvevict.kernels import _pool
from sgl_kvevict.model import default_model_path
from sgl_kvevict.scenarios import agent
from sgl_kvevict.scenarios.base import ScenarioConfig
from sgl_kvevict.tools import oracle

SINKS, WINDOW = 4, 32
CHUNK = 512  # prefill chunk; the last chunk must hold the window (--tokens % CHUNK is 0 or >= WINDOW)
PAGES = (16, 32, 64)
RECALLS = (128, 256, 512)
SUMMARY_METHODS = [("minmax", "max"), ("minmax", "sum"), ("mean", "max"), ("mean", "sum")]
METHODS = [f"{m}/{a}" for m, a in SUMMARY_METHODS] + ["oracle", "recent"]


# -- (1) quality ---------------------------------------------------------------------------------------


def agent_text(tok: Any, seed: int, n_tokens: int) -> torch.Tensor:
    """One agent session flattened to `n_tokens` ids, ending with a new question about a seen service."""
    cfg = ScenarioConfig(sessions=1, turns=12, seed=seed, tool_tokens_min=300, tool_tokens_max=900)
    sess = agent.build(cfg).sessions[0]
    parts = [f"system: {sess.system}"]
    for turn in sess.turns:
        parts += [f"{m.role}: {m.content}" for m in turn.inputs]
    svc = sess.turns[0].inputs[1].content.split("service=")[-1].rstrip(")")
    question = (
        f"\nuser: Going back to the first {svc} output above: which entries reported problems, and what "
        "numbers did they give? Answer briefly.\nassistant:"
    )
    q_ids = tok(question, add_special_tokens=False).input_ids
    ids = tok("\n".join(parts)).input_ids[: n_tokens - len(q_ids)]
    assert len(ids) + len(q_ids) == n_tokens, "session too short for --tokens: raise turns"
    return torch.tensor([ids + q_ids])


def page_truth(t: torch.Tensor, page: int) -> torch.Tensor:
    """[Hkv, p] true attention mass per page (the oracle's page score)."""
    pad = (-t.shape[1]) % page
    return torch.nn.functional.pad(t, (0, pad)).view(t.shape[0], -1, page).sum(-1)


def evaluate_layer(keys: torch.Tensor, q: torch.Tensor, scale: float, acc: dict) -> None:
    """keys [N, Hkv, D], q [Hq, W, D] post-RoPE; adds one sample per (method, page, R, fetch) to acc."""
    n = keys.shape[0]
    true = K.window_attention_ref(q, keys, torch.arange(n), scale, causal=True)  # [Hkv, N]
    host, t = keys[SINKS : n - WINDOW], true[:, SINKS : n - WINDOW]
    e, hkv = host.shape[0], host.shape[1]
    qw = q.permute(1, 0, 2)  # [W, Hq, D]
    for page in PAGES:
        summ = K.page_summaries(host, page)
        scores = {f"{m}/{a}": K.page_scores(qw, *summ, m, scale, a) for m, a in SUMMARY_METHODS}
        scores["oracle"] = page_truth(t, page)
        scores["recent"] = torch.arange(summ[0].shape[0]).float().expand(hkv, -1)
        for r in RECALLS:
            top = t.topk(r, dim=1).indices
            in_top = torch.zeros_like(t, dtype=torch.bool).scatter_(1, top, True)
            best = t.gather(1, top).sum(1)
            for name, s in scores.items():
                for fetch in (1, 2):
                    ids = K.select_pages(s, fetch * r // page)
                    cols, valid = K.gather_columns(ids, page, e)
                    if fetch == 2:  # exact second stage over the fetched columns
                        exact = t.gather(1, cols).masked_fill(~valid, float("-inf"))
                        pick = exact.topk(r, dim=1).indices
                        cols, valid = cols.gather(1, pick), valid.gather(1, pick)
                    hit = (in_top.gather(1, cols) & valid).sum(1).float() / r
                    mass = (t.gather(1, cols) * valid).sum(1) / best
                    key = (name, page, r, fetch)
                    acc.setdefault(key, {"cover": [], "mass": []})
                    acc[key]["cover"] += hit.tolist()
                    acc[key]["mass"] += mass.tolist()


def quality(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer, DynamicCache

    path = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = oracle.load_model(path)
    cfg = model.config
    scale = (cfg.hidden_size // cfg.num_attention_heads) ** -0.5
    acc: dict = {}
    for seed in range(args.texts):
        ids = agent_text(tok, seed, args.tokens)
        t0 = time.time()
        capture = oracle.PastMask(capture_window=WINDOW)
        cache = DynamicCache()
        with torch.no_grad(), oracle.masking(capture):  # chunked: the full [Hq, N, N] logits do not fit here
            for c0 in range(0, ids.shape[1], CHUNK):
                model(input_ids=ids[:, c0 : c0 + CHUNK], past_key_values=cache, use_cache=True)
        print(f"text {seed}: {ids.shape[1]} tokens, prefill {time.time() - t0:.0f}s", flush=True)
        for layer, kv in enumerate(cache.layers):
            evaluate_layer(kv.keys[0].permute(1, 0, 2).contiguous(), capture.queries[layer], scale, acc)
        del cache
    res = {
        f"{name}|{page}|{r}|{fetch}": {
            "cover": statistics.mean(v["cover"]),
            "cover_min": min(v["cover"]),
            "mass": statistics.mean(v["mass"]),
            "samples": len(v["cover"]),
        }
        for (name, page, r, fetch), v in acc.items()
    }
    return {"tokens": args.tokens, "texts": args.texts, "window": WINDOW, "sinks": SINKS, "results": res}


def quality_table(q: dict) -> str:
    res = q["results"]
    head = (
        "| method | page | "
        + " | ".join(f"cover R={r}" for r in RECALLS)
        + " | mass R=256 | cover R=256, fetch 2R | mass R=256, fetch 2R |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for page in PAGES:
        for name in METHODS:
            cells = [f"{res[f'{name}|{page}|{r}|1']['cover']:.3f}" for r in RECALLS]
            cells.append(f"{res[f'{name}|{page}|256|1']['mass']:.3f}")
            cells.append(f"{res[f'{name}|{page}|256|2']['cover']:.3f}")
            cells.append(f"{res[f'{name}|{page}|256|2']['mass']:.3f}")
            lines.append(f"| {name} | {page} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- (2) cost --------------------------------------------------------------------------------------------


def _cost_row(args: argparse.Namespace, cols_n: int, dev: tuple, g: torch.Generator) -> dict:
    """One host size: time the flat and the paged turn, count their bytes."""
    kb, vb, q, dev_slots = dev
    layers, hq, w, d = q.shape
    hkv, r, page, el = kb[0].shape[1], args.recall, args.cost_page, 2
    scale = d**-0.5
    heads = torch.arange(hkv)[:, None]
    hk = torch.randn(layers, cols_n, hkv, d, generator=g).bfloat16()
    hv = torch.randn(layers, cols_n, hkv, d, generator=g).bfloat16()
    summ = [K.page_summaries(hk[layer], page) for layer in range(layers)]
    p = summ[0][0].shape[0]
    n_sel = 2 * r // page

    def flat() -> None:
        host_cols = torch.empty(layers, hkv, r, dtype=torch.int64)
        for layer in range(layers):
            s = K.window_attention_ref(q[layer], hk[layer], torch.arange(cols_n), scale)
            host_cols[layer] = s.topk(r, dim=1).indices
        K.host_swap(kb, vb, dev_slots, hk, hv, host_cols)

    def paged(mode: str) -> None:
        host_cols = torch.empty(layers, hkv, r, dtype=torch.int64)
        for layer in range(layers):
            s = K.page_scores(q[layer].transpose(0, 1), *summ[layer], mode, scale)
            cols, valid = K.gather_columns(K.select_pages(s, n_sel), page, cols_n)
            cand = _pool.head_rows(hk[layer], cols, heads)  # [Hkv, 2R, D] fetched from the host
            qg = q[layer].float().reshape(hkv, -1, d)
            exact = torch.softmax(qg @ cand.float().transpose(1, 2) * scale, -1).mean(1)
            pick = exact.masked_fill(~valid, float("-inf")).topk(r, dim=1).indices
            host_cols[layer] = cols.gather(1, pick)
        K.host_swap(kb, vb, dev_slots, hk, hv, host_cols)

    def build() -> None:
        for layer in range(layers):
            K.page_summaries(hk[layer], page)

    def sec(fn) -> float:
        return statistics.median(times_ms(fn, args.repeats, clock=time.process_time)) / 1e3

    swap_b = 2 * 2 * layers * r * hkv * d * el  # K and V, both directions
    return {
        "host_cols": cols_n,
        "pages": p,
        "flat_s": sec(flat),
        "minmax_s": sec(lambda: paged("minmax")),
        "mean_s": sec(lambda: paged("mean")),
        "summaries_build_s": sec(build),
        "flat_host_bytes": layers * cols_n * hkv * d * el + swap_b,
        "paged_host_bytes": layers * 2 * r * hkv * d * el + swap_b,
        "swap_bytes": swap_b,
        "minmax_summary_bytes": layers * p * hkv * d * 4 * 2,
        "mean_summary_bytes": layers * p * hkv * d * 4,
    }


def cost(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    layers, hq, hkv, d, w, r = 30, 9, 3, 64, WINDOW, args.recall
    slots_n = 1024 + r  # device rows: a budget of 1024 plus R
    g = torch.Generator().manual_seed(0)
    kb = [torch.randn(slots_n, hkv, d, generator=g).bfloat16() for _ in range(layers)]
    vb = [torch.randn(slots_n, hkv, d, generator=g).bfloat16() for _ in range(layers)]
    q = torch.randn(layers, hq, w, d, generator=g).bfloat16()
    dev_slots = torch.arange(r).expand(layers, hkv, r).contiguous()  # the displaced (lowest-scored) rows
    rows = []
    for cols_n in (2048, 8192, 32768):
        rows.append(_cost_row(args, cols_n, (kb, vb, q, dev_slots), g))
        print(json.dumps(rows[-1]), flush=True)
    meta = {"layers": layers, "hq": hq, "hkv": hkv, "d": d, "window": w, "recall": r, "page": args.cost_page}
    return {**meta, "rows": rows}


def _mb(b: int) -> str:
    return f"{b / 2**20:.2f}"


def cost_table(c: dict) -> str:
    lines = [
        "| host columns | flat s | pages minmax s | pages mean s | flat host MiB | pages host MiB "
        "| of which swap MiB | minmax summaries MiB | mean summaries MiB | summaries build s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in c["rows"]:
        lines.append(
            f"| {x['host_cols']} | {x['flat_s']:.3f} | {x['minmax_s']:.3f} | {x['mean_s']:.3f} | "
            f"{_mb(x['flat_host_bytes'])} | {_mb(x['paged_host_bytes'])} | {_mb(x['swap_bytes'])} | "
            f"{_mb(x['minmax_summary_bytes'])} | {_mb(x['mean_summary_bytes'])} | {x['summaries_build_s']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--texts", type=int, default=2)
    ap.add_argument("--recall", type=int, default=256)
    ap.add_argument("--cost-page", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--out", default="results/recall-pages")
    args = ap.parse_args()
    if 0 < args.tokens % CHUNK < WINDOW:
        ap.error(f"--tokens % {CHUNK} must be 0 or >= {WINDOW} (the last prefill chunk holds the window)")
    if not 2 * SINKS + WINDOW + max(RECALLS) * 2 <= args.tokens <= 8192:
        ap.error("--tokens must be in [1100, 8192] (the model's context; room for 2R host columns)")
    if args.recall < 1 or args.recall * 2 > 2048 or args.recall % args.cost_page:
        ap.error("--recall must be in [1, 1024] and a multiple of --cost-page")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if not args.skip_quality:
        torch.set_num_threads(2)
        q = quality(args)
        (out / "quality.json").write_text(json.dumps(q, indent=1))
        table = quality_table(q)
        (out / "quality.md").write_text(table + "\n")
        print(table, flush=True)
    if not args.skip_cost:
        c = cost(args)
        (out / "cost.json").write_text(json.dumps(c, indent=1))
        table = cost_table(c)
        (out / "cost.md").write_text(table + "\n")
        print(table, flush=True)


if __name__ == "__main__":
    main()
