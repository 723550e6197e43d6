"""One compression call per scheduler step: every request whose trigger fires, batched.

`compress_batch` takes the step's requests, decides on the host which ones compress and every count
that decides slots (region length, sinks, recent window, budget, so the kept count `k` per request), and
then runs the tensor work once for all of them wherever it can:

- *batched* (the common path): the region is the request's own (no tree-owned slot in it), the policy
  does not merge, and its selection is one of those written here over `[requests, layers, heads,
  tokens]` (`streaming`, `knorm`, `h2o`, `snapkv`: equal budgets across layers and heads make one
  top-k over all of them exact; `lagkv`: its partitions, chunk recursion and final cut for all
  requests and layers at once, `engine_lagkv`). Requests of different lengths are padded to the
  longest; every ragged index is built on the host from host-known lengths (for LagKV, every count of
  its recursion too), so the step never reads a device value: no host
  synchronisation (`tests/test_engine_sync.py` counts them). Compaction moves each request's kept
  tokens into the first `k` slots of its region, one gather and one write per layer and buffer for all
  requests together, and the rest of the slots go back to the allocator in one call.
- *per request* (`compressor.run`): everything else (merging policies, the refiners, GraphKV over
  LagKV included, a region that starts in the tree, a capture window not yet full).

Plan / agree / commit is kept: the batched plan writes nothing; tensor-parallel ranks agree on its
success (one all-reduce for the batch); if it fails anywhere, every request of the batch goes through
the per-request path instead, which degrades only the request whose policy failed.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from sgl_kvevict.cache import capture, compressor, demote, engine_lagkv, ragged, slotstats
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.compressor import Job
from sgl_kvevict.policies.base import Phase

logger = logging.getLogger("sgl_kvevict")

# policies with a selection written over the batch (LagKV's in `engine_lagkv`)
BATCHED = ("streaming", "knorm", "h2o", "snapkv", "lagkv")
# Bound on one chunk of window-attention logits (fp32 elements): requests are scored in chunks below it.
MAX_LOGITS = 1 << 26


def _policy_key(job: Job) -> str | None:
    """The batch group of a job, or None when it must take the per-request path."""
    s = job.s
    pol = s.policy
    if type(pol).__module__.split(".")[-1] not in BATCHED or pol.name not in BATCHED:
        return None
    if job.own_start > job.a or pol.merges:
        return None
    if "attn" in pol.needs:
        w = pol.config.window
        if w > job.a + job.n or capture.count(job.s.ctx, job.req.kv.req_pool_idx, _length(job)) < w:
            return None
    return pol.name + json.dumps(pol.config.model_dump(mode="json"), sort_keys=True)


def _length(job: Job) -> int:
    """The request's logical length: the positions its captured queries are indexed by."""
    return job.s.tokens_for(job.a + job.n)


def compress_batch(items: list[tuple[Any, Phase]], cap: int | None = None) -> list[int]:
    """Compress every request whose trigger fires; returns the slots each request freed (0 if none).

    A policy failure degrades only its request (as `compressor.safe_compress` does one at a time).
    `cap`: region tokens this step may compress (`--kv-compress-step-tokens`); see `_defer`."""
    freed = [0] * len(items)
    jobs: list[tuple[int, Job]] = []
    for i, (req, phase) in enumerate(items):
        try:
            job = compressor.prepare(req, phase)
        except Exception:
            compressor.degrade(req)
            continue
        if job is not None:
            jobs.append((i, job))
    if cap is not None:
        jobs = _defer(jobs, cap)
    groups: dict[str, list[tuple[int, Job]]] = {}
    single: list[tuple[int, Job]] = []
    for i, job in jobs:
        key = None if _split(job, cap) else _policy_key(job)
        (single if key is None else groups.setdefault(key, [])).append((i, job))
    for members in groups.values():
        done = None
        error = None
        try:
            done = _run_group([j for _, j in members])
        except Exception as e:
            error = e
        if not compressor.agree(members[0][1].s.ctx.rt, error is None) or done is None:
            logger.warning("kvevict: batched compression failed (%s); per request instead", error)
            single.extend(members)
            continue
        for (i, _), f in zip(members, done, strict=True):
            freed[i] = f
    for i, job in single:
        freed[i] = compressor.safe_run(job)
    return freed


def _split(job: Job, cap: int | None) -> bool:
    """Whether the job plans only part of its layers this step: its region is larger than the step's
    cap (about `cap` region tokens' worth of layers run per step), or it is already under way."""
    if cap is None or (job.n <= cap and job.s.pending is None):
        return job.s.pending is not None
    job.layers = max(1, cap * job.s.ctx.rt.n_layers // max(1, job.n))
    return True


def _defer(jobs: list[tuple[int, Job]], cap: int) -> list[tuple[int, Job]]:
    """The jobs that run this step: split plans under way first (finishing them frees their memory
    soonest), then those that waited longest, until their regions cover `cap` tokens (at least one
    runs, so every step progresses). The rest wait; a job deferred right after prefill keeps its phase
    for the step that runs it."""
    order = sorted(jobs, key=lambda ij: (ij[1].s.pending is None, -ij[1].s.deferred))
    run, spent = [], 0
    for i, job in order:
        if run and spent >= cap:
            job.s.deferred += 1
            job.s.after_extend = job.phase == "prefill"
            job.s.ctx.rt.totals.compressions_deferred += 1
            continue
        job.s.deferred = 0
        spent += min(job.n, cap)  # a larger job plans only part of its layers (`_split`)
        run.append((i, job))
    return run


def _host_index(lengths: list[int], width: int, device: torch.device) -> torch.Tensor:
    """Flat positions `r * width + j` for j < lengths[r]: where ragged rows sit in a padded layout."""
    starts = [r * width for r in range(len(lengths))]
    return ragged.aranges(starts, lengths).to(device, non_blocking=True)


def _col(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).view(-1, 1).to(device, non_blocking=True)


def _run_group(jobs: list[Job]) -> list[int]:
    """Plan (select) for the group's requests at once, then commit: compaction and frees for all."""
    t0 = time.perf_counter()
    rt = jobs[0].s.ctx.rt
    rt.order_after_forward()
    pol = jobs[0].s.policy
    dev = rt.req_to_token.device
    L, H = rt.n_layers, rt.n_kv_heads  # noqa: N806
    R = len(jobs)  # noqa: N806
    ns = [j.n for j in jobs]
    lag_counts = None
    if pol.name == "lagkv":  # kept counts from partitions and the chunk recursion, still host-only
        lag_counts = [engine_lagkv.counts(j) for j in jobs]
        ks = [c.k for c in lag_counts]
        tails = [min(c.raw, c.k) for c in lag_counts]
        if any(k >= n for k, n in zip(ks, ns, strict=True)):
            raise RuntimeError("lagkv: a request of the group keeps its whole region")
    else:
        b = [min(j.budget, max(0, j.n - j.n_sink - j.n_recent)) for j in jobs]
        ks = [j.n_sink + bb + j.n_recent for j, bb in zip(jobs, b, strict=True)]
        tails = [min(j.n_recent, k) for j, k in zip(jobs, ks, strict=True)]
    if all(k >= j.n for k, j in zip(ks, jobs, strict=True)):
        return [0] * R
    nmax, kmax = max(ns), max(ks)
    rows = [j.req.kv.req_pool_idx for j in jobs]
    anchors = [j.a for j in jobs]

    # region slots, padded [R, Nmax] (padding reads the row's first slot; it is never kept)
    pad_pos = torch.arange(nmax, dtype=torch.int64).unsqueeze(0)
    n_col = torch.tensor(ns, dtype=torch.int64).view(-1, 1)
    cols = (torch.tensor(anchors, dtype=torch.int64).view(-1, 1) + pad_pos.clamp(max=n_col - 1)).to(dev)
    row_t = _col(rows, dev)
    slots_pad = rt.req_to_token[row_t, cols].to(torch.int64)  # [R, Nmax]
    valid = (pad_pos < n_col).to(dev)  # [R, Nmax]

    carried_scores = None
    if lag_counts is not None:
        keep = engine_lagkv.select(jobs, lag_counts, slots_pad)  # [R, L, H, Kmax]
    elif pol.name == "streaming":
        # the newest b candidates of every head: sinks, then the contiguous run [n - (k - sinks), n)
        pos = torch.arange(kmax, dtype=torch.int64).unsqueeze(0)
        shift = torch.tensor([j.n - k for j, k in zip(jobs, ks, strict=True)], dtype=torch.int64).view(-1, 1)
        sink = torch.tensor([j.n_sink for j in jobs], dtype=torch.int64).view(-1, 1)
        keep = torch.where(pos < sink, pos, pos + shift).to(dev)  # [R, Kmax]
        keep = keep.view(R, 1, 1, kmax).expand(R, L, H, kmax)
    else:
        scores = _scores(pol, jobs, slots_pad, cols, valid)  # [R, L, H, Nmax] float32
        if "attn" in pol.needs:
            scores = _carry(jobs, scores, nmax)
            carried_scores = scores
        sink_col = torch.tensor([j.n_sink for j in jobs], dtype=torch.int64).view(-1, 1)
        recent_col = torch.tensor([j.n_recent for j in jobs], dtype=torch.int64).view(-1, 1)
        fixed = ((pad_pos < sink_col) | ((pad_pos >= n_col - recent_col) & (pad_pos < n_col))).to(dev)
        ranked = scores.masked_fill(~valid.view(R, 1, 1, nmax), float("-inf"))
        ranked = ranked.masked_fill(fixed.view(R, 1, 1, nmax), float("inf"))
        keep = ranked.topk(kmax, dim=-1).indices  # [R, L, H, Kmax]: fixed first, then the best candidates
    # entries past a request's own k go last, then every head's kept indices in position order
    if lag_counts is None:  # (LagKV's come sorted and padded)
        past = (torch.arange(kmax).unsqueeze(0) >= torch.tensor(ks).view(-1, 1)).to(dev)  # [R, Kmax]
        keep = keep.masked_fill(past.view(R, 1, 1, kmax), nmax).sort(dim=-1).values

    # demote (recall on): the entries each request evicts, copied to host columns before any write
    dems = [
        demote.plan_demote(j.s, j.a, slots_pad[r, : j.n], keep[r, :, :, :k]) if demote.enabled(j.s) else None
        for r, (j, k) in enumerate(zip(jobs, ks, strict=True))
    ]
    # commit: nothing below can fail on valid indices; a failure above left everything as it was
    sel = _host_index(ks, kmax, dev)  # [sum k] valid (request, i) pairs of the padded kept layout
    src = slots_pad.gather(1, keep.clamp(max=nmax - 1).reshape(R, -1)).view(R, L, H, kmax)
    src = src.permute(1, 0, 3, 2).reshape(L, R * kmax, H).index_select(1, sel)  # [L, sum k, H]
    heads = torch.arange(H, device=dev)
    src_rows = (src * H + heads).reshape(L, -1)  # [L, sum k * H] flat (slot, head) pool rows
    dst = slots_pad[:, :kmax].reshape(-1).index_select(0, sel)  # the first k region slots
    dst_rows = (dst.unsqueeze(-1) * H + heads).reshape(-1)
    for layer in range(L):
        for buf in (rt.k_buffer(layer), rt.v_buffer(layer)):
            flat = buf.view(-1, buf.shape[-1])
            flat.index_copy_(0, dst_rows, flat.index_select(0, src_rows[layer]))  # gather, then write
    stats = jobs[0].s.ctx.stats
    if stats is not None:  # the per-slot statistic moves with its row, all layers in one op
        slotstats.move_rows(stats, src_rows, dst_rows)
    evicted = slots_pad.reshape(-1).index_select(0, _tail_index(ks, ns, nmax, dev))
    rt.allocator.free(evicted)
    for j, d in zip(jobs, dems, strict=True):
        demote.commit_demote(j.s, d, True)

    # host bookkeeping per request; the tensor state (carried scores, row offsets) in one op each
    for j in jobs:
        if not j.s.layer_state:
            j.s.layer_state = [{} for _ in range(L)]
    if carried_scores is not None:
        carried = carried_scores.gather(-1, keep.clamp(max=nmax - 1))  # [R, L, H, Kmax]
        for r, (j, k) in enumerate(zip(jobs, ks, strict=True)):
            per = carried[r, :, :, :k]
            for layer, d in enumerate(j.s.layer_state):
                d.pop("scored", None)
                d["carried"] = per[layer]
            j.s.carry_stack = per
    dt = (time.perf_counter() - t0) / R
    offs = []
    for r, (j, k) in enumerate(zip(jobs, ks, strict=True)):
        kr = keep[r, :, :, :k] if st.DEBUG else None
        kv = j.req.kv
        kv.kv_committed_len = kv.kv_allocated_len = j.a + k
        offs.append(compressor.account(j, k, tails[r], kr, dt))
    rt.tree.offsets[torch.tensor(rows, dtype=torch.int64).to(rt.tree.offsets.device)] = torch.tensor(
        offs, dtype=rt.tree.offsets.dtype
    ).to(rt.tree.offsets.device)
    return [j.n - k for j, k in zip(jobs, ks, strict=True)]


def _tail_index(ks: list[int], ns: list[int], width: int, device: torch.device) -> torch.Tensor:
    """Flat padded positions `r * width + j` for ks[r] <= j < ns[r]: the slots each request frees."""
    starts = [r * width + k for r, k in enumerate(ks)]
    drop = [n - k for k, n in zip(ks, ns, strict=True)]
    return ragged.aranges(starts, drop).to(device, non_blocking=True)


def _scores(
    pol: Any, jobs: list[Job], slots_pad: torch.Tensor, cols: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """`[R, L, H, Nmax]` float32 scores of every request's region on every layer. `cols`: each
    request's padded region positions in its row; `valid`: which of them are real."""
    rt = jobs[0].s.ctx.rt
    R, L, H, nmax = len(jobs), rt.n_layers, rt.n_kv_heads, slots_pad.shape[1]  # noqa: N806
    if pol.name == "knorm":
        flat = slots_pad.reshape(-1)
        norms = torch.stack(
            [rt.k_buffer(layer).index_select(0, flat).float().norm(dim=-1) for layer in range(L)]
        )  # [L, R*Nmax, H]
        return -norms.view(L, R, nmax, H).permute(1, 0, 3, 2)
    attn = _window_attention(jobs, cols, valid)  # [R, L, H, Nmax]
    if pol.name == "h2o":
        return attn * pol.config.window
    from sgl_kvevict.policies.snapkv import pool_scores

    return pool_scores(attn.reshape(-1, nmax), pol.config.kernel_size, pol.config.pooling).view(R, L, H, nmax)


def _window_attention(jobs: list[Job], reg: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`kernels.window_attention(causal=True)` for every request and layer at once, restricted to each
    region: `[R, L, Hkv, Nmax]`, zeros in the padding. Keys are each request's whole row (prefix +
    region), padded; the causal mask and the padding come from host-known lengths. `reg`, `valid`: the
    group's padded region positions in each row and which of them are real."""
    rt = jobs[0].s.ctx.rt
    dev = rt.req_to_token.device
    R, L, H, Hq, D = len(jobs), rt.n_layers, rt.n_kv_heads, rt.n_q_heads, rt.head_dim  # noqa: N806
    g = Hq // H
    w = jobs[0].s.policy.config.window
    alls = [j.a + j.n for j in jobs]
    amax = max(alls)
    pos = torch.arange(amax, dtype=torch.int64).unsqueeze(0)
    all_col = torch.tensor(alls, dtype=torch.int64).view(-1, 1)
    rows = _col([j.req.kv.req_pool_idx for j in jobs], dev)
    slots = rt.req_to_token[rows, pos.clamp(max=all_col - 1).to(dev)].to(torch.int64).reshape(-1)  # [R*A]
    # query i of the window sits at position len - w + i and sees keys up to there; padding sees nothing
    limit = (all_col - w).view(R, 1, 1, 1) + torch.arange(w).view(1, 1, w, 1)  # [R, 1, W, 1]
    masked = (torch.arange(amax).view(1, 1, 1, amax) > limit).to(dev)  # [R, 1(G), W, A]
    # every request's last w queries, oldest first, in one gather out of the capture store
    q_all = jobs[0].s.ctx.capture.stacked(
        [j.req.kv.req_pool_idx for j in jobs], [_length(j) for j in jobs], w
    )
    nmax = reg.shape[1]  # `reg`: the region part of each row, a padded [R, Nmax] gather out of [R, A]
    out = torch.zeros(R, L, H, nmax, dtype=torch.float32, device=dev)
    step = max(1, MAX_LOGITS // max(1, H * g * w * amax))
    for layer in range(L):
        k = rt.k_buffer(layer).index_select(0, slots).float().view(R, amax, H, D)
        q = q_all[:, layer].float().view(R, w, H, g, D).permute(0, 2, 3, 1, 4)  # [R, H, G, W, D]
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            kh = k[r0:r1].permute(0, 2, 3, 1)  # [r, H, D, A]
            logits = torch.matmul(q[r0:r1].reshape(r1 - r0, H, g * w, D), kh).mul_(rt.scale)
            logits = logits.view(r1 - r0, H, g, w, amax).masked_fill_(
                masked[r0:r1].unsqueeze(1), float("-inf")
            )
            p = torch.softmax(logits, dim=-1).mean(dim=(2, 3))  # [r, H, A]
            out[r0:r1, layer] = p.gather(2, reg[r0:r1].unsqueeze(1).expand(r1 - r0, H, nmax))
    return out.masked_fill_(~valid.view(R, 1, 1, nmax), 0.0)


def _carry(jobs: list[Job], scores: torch.Tensor, nmax: int) -> torch.Tensor:
    """`policies.base.carry_scores` for the batch: each request's first kept tokens combine their new
    score with the one carried from its last compression ('max' or 'decay'; 'none' ignores it)."""
    cfg = jobs[0].s.policy.config
    if cfg.carry == "none":
        return scores
    R, L, H = scores.shape[0], scores.shape[1], scores.shape[2]  # noqa: N806
    olds, lens = [], []
    for j in jobs:
        old = _carried_stack(j.s)
        m = 0 if old is None else min(int(old.shape[-1]), j.n)
        lens.append(m)
        if m:
            olds.append(old[..., :m].to(scores.device, torch.float32).reshape(L * H, m))
    if not any(lens):
        return scores
    flat = torch.cat(olds, dim=1)  # [L*H, sum m]
    idx = _host_index(lens, nmax, scores.device)  # positions in [R * Nmax]
    prior = torch.full((L * H, R * nmax), float("-inf") if cfg.carry == "max" else 0.0, device=scores.device)
    prior.index_copy_(1, idx, flat)
    prior = prior.view(L, H, R, nmax).permute(2, 0, 1, 3)
    if cfg.carry == "max":
        return torch.maximum(scores, prior)
    return scores + cfg.carry_decay * prior


def _carried_stack(s: st.ReqState) -> torch.Tensor | None:
    """`[L, H, m]` carried scores of a request: the stacked tensor its last batched compression left
    (when every layer's entry is still a view of it), else a stack of the per-layer entries."""
    per = [d.get("carried") for d in s.layer_state]
    if not per or any(x is None for x in per):
        return None
    base = getattr(s, "carry_stack", None)
    if (
        base is not None
        and base.shape[0] == len(per)
        and all(x.data_ptr() == base[i].data_ptr() and x.shape == base[i].shape for i, x in enumerate(per))
    ):
        return base
    if len({tuple(x.shape) for x in per}) != 1:
        return None
    return torch.stack(per)
