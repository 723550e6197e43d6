"""Decode-time recall in fixed shapes: the form a CUDA graph can hold.

A decode step's recall has three parts, and only the middle one runs inside the forward:

1. `arm` and `plan` (the scheduler, before the step): a request due to recall gets a `DecodeArm` (the
   row range it may displace, how many entries it may swap per layer and KV head, its branch's host
   columns); `plan` turns the batch's arms into a `StepPlan` of device tensors, one row per request of
   the batch, padded: a request that does not recall this step has `r = 0`, padded host columns name the
   host pool's scratch column.
2. `StepPlan.layer` (inside the forward, before each layer's attention): for the whole batch at once,
   the step's query scores the branch's host entries and the row's entries in one softmax; in every
   layer and every KV head, the best-ranked host pages that beat the lowest-scored displaceable entries
   (and whose best entry gets at least `recall_core.MIN_SCORE` of a query's attention) exchange places
   with them (`kernels.host_swap`).
   Every tensor has a shape fixed by the plan (batch B, row width W, host columns C, swaps R): no host
   sync, no Python branch on a tensor's value, no shape that follows the data
   (`tests/test_decode_recall.py` checks the op sequence). Pairs that do not move name device slot 0
   (SGLang's slot for padded tokens, never read) and the scratch column. Each exchange is recorded on
   the device.
3. `finish` (the scheduler, after the step): the records become the requests' counters, debug positions,
   stale page summaries and stale per-slot statistics, read once for the whole batch (a compression
   never runs between a step and its `finish`: `hooks.get_next_batch_to_run` processes the step first).

On a CPU with bf16 pools, `StepPlan.layer` runs `kernels.recall_layer_cpu` instead: the same decisions and
exchange in one compiled loop (at batch 1 the ~100 small ops of this torch form cost more than their
arithmetic), tested equal to `choose` and `host_swap`.

The ranking is `recall.exchange`'s (the same `recall_core.best_entries`, the same floor) over every host entry of
the branch; the page summaries that a turn's recall uses to fetch fewer keys are not used here.
On a GPU a graph would be captured per (B, W, C, R) bucket (`bucket`), as SGLang captures one per batch size; the
host keys are read through an index on the host store (a pinned-memory gather kernel would make that
read graph-safe too). Both are written against the interfaces and not exercised on this CPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from sgl_kvevict import kernels as K
from sgl_kvevict.cache import state as st
from sgl_kvevict.cache.host_tier import recall_core
from sgl_kvevict.cache.host_tier.recall_core import SwapPositions, account, best_entries, mark_stale

if TYPE_CHECKING:
    from sgl_kvevict.cache.context import KvEvictContext

logger = logging.getLogger("sgl_kvevict")
MIN_WIDTH = 64  # the smallest row-width and host-column bucket
STEPS_PER_OCTAVE = 4  # bucket sizes between two powers of two: padding stays under 1 / 4 of the size
MAX_BUCKETS = 32  # the buckets whose device tensors a server keeps (`buffers`)


def bucket(n: int, cap: int | None = None) -> int:
    """The fixed size a plan rounds `n` up to, at most `cap`: `MIN_WIDTH`, then `STEPS_PER_OCTAVE` sizes
    per power of two (1280, 1536, 1792, 2048, 2560, ...). Every layer of a step scores every padded
    column, so the padding is paid in time; each size is one more shape for a graph to capture."""
    n = max(int(n), MIN_WIDTH)
    step = max(MIN_WIDTH, (1 << (n - 1).bit_length()) // (2 * STEPS_PER_OCTAVE))
    out = -(-n // step) * step
    return out if cap is None else min(out, cap)


class StepBounds(NamedTuple):
    """What a plan fixes for every layer of the step, computed once per step: per batch row, the logits'
    padding (`pad` `[B, 1, 1, C + W]`: False on its real host columns, then on its entries before the
    step's token, True elsewhere), its padded host columns (`not_host` `[B, 1, C]`), its entries that may not be
    displaced (`fixed` `[B, 1, W]`), its host columns `cols` `[B, 1, C]` and their rows in the host pool's
    flat `[columns * H, D]` view (`host_ids` `[B, H, C]`), its swaps (`first_r` `[B, 1, R]`); for all rows,
    the page, the swaps per head `swaps`, the score floor and the scratch column."""

    pad: torch.Tensor
    not_host: torch.Tensor
    fixed: torch.Tensor
    first_r: torch.Tensor
    cols: torch.Tensor
    host_ids: torch.Tensor
    page: int
    swaps: int
    min_score: float
    scratch: int


class Exchange(NamedTuple):
    """One layer's decision, `[B, H, R]` each: the displaced row positions, the branch's host indices, the
    device slots and host columns to exchange (slot 0 and the scratch column where nothing moves), and
    whether the pair moves (a prefix of each row and head)."""

    pos: torch.Tensor
    hidx: torch.Tensor
    dev_slots: torch.Tensor
    host_cols: torch.Tensor
    moved: torch.Tensor


def choose(
    q: torch.Tensor,
    keys_row: torch.Tensor,
    keys_host: torch.Tensor,
    slots: torch.Tensor,
    b: StepBounds,
    scale: float,
) -> Exchange:
    """Which entries a layer exchanges, from the step's queries `q` `[B, Hq, D]`, the rows' keys
    `[B, H, W, D]` (in slots `[B, W]`) and the branch's host keys `[B, H, C, D]` (heads first, as
    `StepPlan.gather` reads them), in every KV head: device math only, on shapes the plan fixed, so it
    compiles to one graph (`tests/test_decode_recall.py` checks it under `torch.compile(fullgraph=True)`)."""
    n, h, w, d = keys_row.shape
    c, r = keys_host.shape[2], b.swaps
    qf = q.float().view(n, h, -1, d)  # [B, H, G, D]: query heads grouped by KV head
    logits = torch.cat(
        [
            torch.matmul(qf, keys_host.float().transpose(-1, -2)),
            torch.matmul(qf, keys_row.float().transpose(-1, -2)),
        ],
        dim=-1,
    )
    # [B, H, G, C + W], padding at -inf whatever it holds: a padded column reads the host pool's scratch
    # column and a padded row entry any slot, uninitialised memory that may be NaN (added to -inf, a NaN
    # would void the whole softmax of its row and head)
    logits = logits.mul(scale).masked_fill_(b.pad, -torch.inf)
    p = torch.softmax(logits, dim=-1).amax(dim=2)  # [B, H, C + W]: an entry's best query head
    # padding stays out of the ranking (a page's best would otherwise rank its padded entries too)
    host_sc, row_sc = p[..., :c].masked_fill(b.not_host, -torch.inf), p[..., c:]
    hs, hidx = best_entries(host_sc, b.page, r)  # [B, H, R], best first
    cs, pos = row_sc.masked_fill(b.fixed, torch.inf).neg_().topk(r, dim=-1)
    moved = (hs > -cs) & (hs >= b.min_score) & b.first_r  # a prefix of each (row, head)
    dev_slots = torch.where(moved, slots.unsqueeze(1).expand(n, h, w).gather(-1, pos), 0)
    host_cols = b.cols.expand(n, h, c).gather(-1, hidx)
    return Exchange(pos, hidx, dev_slots, torch.where(moved, host_cols, b.scratch), moved)


@dataclass(eq=False)
class DecodeArm:
    """One request's recall in the next decode step: rows `[lo, hi)` may be displaced, at most `r` entries
    per layer and KV head move, with the branch's host columns `cols` (as they are when armed)."""

    s: st.ReqState
    lo: int
    hi: int
    r: int
    tokens: int  # logical tokens the row stands for (debug events)
    cols: torch.Tensor


@dataclass(eq=False)
class StepBuffers:
    """One bucket's device tensors (see `buffers`): the plan's inputs, `[B]` and `[B, 1, C]`, what it derives
    from them once for every layer (`StepBounds`' masks and indices), the KV heads `[H]`, and its records,
    `[L, B, H, R]` per layer (displaced row positions, branch column indices, device slots, host columns, whether the pair
    moved). Allocated once per bucket and refilled by each plan of it, so a CUDA graph captured for the
    bucket reads and writes the same addresses at every replay."""

    rows: torch.Tensor
    m: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    r: torch.Tensor
    n_cols: torch.Tensor
    cols: torch.Tensor
    pad: torch.Tensor
    not_host: torch.Tensor
    fixed: torch.Tensor
    first_r: torch.Tensor
    host_ids: torch.Tensor
    heads: torch.Tensor
    pos: torch.Tensor
    hidx: torch.Tensor
    dev_slots: torch.Tensor
    host_cols: torch.Tensor
    moved: torch.Tensor

    @classmethod
    def allocate(
        cls, bucket_key: tuple[int, int, int, int], layers: int, heads: int, dev: torch.device
    ) -> StepBuffers:
        b, w, c, r = bucket_key
        ints = [torch.zeros(b, dtype=torch.int64, device=dev) for _ in range(6)]
        cols = torch.zeros(b, 1, c, dtype=torch.int64, device=dev)
        pad = torch.zeros(b, 1, 1, c + w, dtype=torch.bool, device=dev)
        masks = [torch.zeros(b, 1, n, dtype=torch.bool, device=dev) for n in (c, w, r)]
        host_ids = torch.zeros(b, heads, c, dtype=torch.int64, device=dev)
        recs = [torch.zeros(layers, b, heads, r, dtype=torch.int64, device=dev) for _ in range(4)]
        moved = torch.zeros(layers, b, heads, r, dtype=torch.bool, device=dev)
        return cls(*ints, cols, pad, *masks, host_ids, torch.arange(heads, device=dev), *recs, moved)

    def derive(self) -> None:
        """Fill what every layer of the step reads from the plan's inputs (once per step, not per layer)."""

        def below(n: int, hi: torch.Tensor) -> torch.Tensor:  # [B, 1, n]: index < hi, per batch row
            return torch.arange(n, device=hi.device) < hi.view(-1, 1, 1)

        c = self.cols.shape[-1]
        w = self.pad.shape[-1] - c
        in_host = below(c, self.n_cols)
        self.not_host.copy_(~in_host)
        valid = torch.cat([in_host, below(w, self.m)], dim=-1).unsqueeze(1)  # [B, 1, 1, C + W]
        self.pad.copy_(~valid)
        self.fixed.copy_(below(w, self.lo) | ~below(w, self.hi))  # outside [lo, hi)
        self.first_r.copy_(below(self.first_r.shape[-1], self.r))
        self.host_ids.copy_(self.cols * self.heads.numel() + self.heads.view(1, -1, 1))


def buffers(ctx: KvEvictContext, bucket_key: tuple[int, int, int, int]) -> StepBuffers:
    """A `StepBuffers` of the bucket (batch, row width, host columns, swaps) that no step in flight holds:
    under the overlap scheduler a step is planned before the previous step's records are read, so a
    bucket keeps one set per step in flight (two). Kept for the `MAX_BUCKETS` most recently used buckets."""
    held = ctx.step_buffers
    sets = held.pop(bucket_key, [])
    busy = {id(p.buf) for p in ctx.steps_in_flight if p is not None}
    buf = next((b for b in sets if id(b) not in busy), None)
    if buf is None:
        buf = StepBuffers.allocate(bucket_key, ctx.rt.n_layers, ctx.host.heads, ctx.rt.req_to_token.device)
        sets.append(buf)
    while len(held) >= MAX_BUCKETS:
        held.pop(next(iter(held)))
    held[bucket_key] = sets  # most recent last
    return buf


@dataclass(eq=False)
class StepPlan:
    """A decode step's recall for a batch, as device tensors of fixed shapes (see the module)."""

    arms: list[DecodeArm | None]  # per batch row (host side, for `finish`)
    buf: StepBuffers  # the bucket's tensors, refilled for this step
    bounds: StepBounds  # what every layer reads: views of `buf`'s inputs and the plan's constants
    width: int  # W
    row_ids: list[int]  # the batch's request rows on the host (-1: none)
    fused: bool = False  # each layer runs `kernels.recall_layer_cpu` (`fused_on_cpu`), decided once per step
    row_read: tuple[torch.Tensor, torch.Tensor] | None = None  # `row`'s, read at the step's first layer
    layers_done: int = 0
    failed: bool = False
    overlapped: bool = False  # planned while the previous decode step's results were still pending

    # the step's records, in the bucket's tensors, [L, B, H, R]: displaced row positions, branch column
    # indices, device slots, host columns, and whether the pair moved
    pos = property(lambda self: self.buf.pos)
    hidx = property(lambda self: self.buf.hidx)
    dev_slots = property(lambda self: self.buf.dev_slots)
    host_cols = property(lambda self: self.buf.host_cols)
    moved = property(lambda self: self.buf.moved)

    @property
    def batch(self) -> int:
        return int(self.buf.rows.shape[0])

    def layer(self, ctx: KvEvictContext, layer: int, q: torch.Tensor) -> None:
        """Score and exchange at `layer`, in every KV head, with the step's queries `q` `[B, Hq, D]`;
        fixed shapes only."""
        if self.fused:
            self._fused(ctx, layer, q)
            return
        slots, keys_row, keys_host = self.gather(ctx, layer)
        ex = choose(q[: self.batch], keys_row, keys_host, slots, self.bounds, ctx.rt.scale)
        _swap(ctx, layer, ex.dev_slots, ex.host_cols)
        self._record(layer, ex)

    def _fused(self, ctx: KvEvictContext, layer: int, q: torch.Tensor) -> None:
        """`layer` on a CPU: the same decisions and exchange in one compiled loop
        (`kernels.recall_layer_cpu`), written straight into the step's records."""
        slots, row_ids = self.row(ctx)
        b, buf = self.bounds, self.buf
        K.recall_layer_cpu(
            q[: self.batch], ctx.rt.k_buffer(layer), ctx.rt.v_buffer(layer), ctx.host.k[layer], ctx.host.v[layer],
            row_ids, b.host_ids, b.pad, b.not_host, b.fixed, buf.r, b.page, b.swaps, b.min_score,
            ctx.rt.scale, slots, b.cols, b.scratch,
            (buf.pos[layer], buf.hidx[layer], buf.dev_slots[layer], buf.host_cols[layer], buf.moved[layer]),
        )  # fmt: skip
        self.layers_done = layer + 1

    def gather(self, ctx: KvEvictContext, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' slots `[B, W]` and, heads first, their keys `[B, H, W, D]` and the branches' host keys
        `[B, H, C, D]` at `layer`: one `index_select` each over the pool's flat `[slots * H, D]` view
        (`kernels.flat_rows`), in the layout the scores' batched product reads (on a CPU several times
        faster than indexing by a 2-D tensor and permuting)."""
        slots, row_ids = self.row(ctx)
        k_dev, k_host = ctx.rt.k_buffer(layer), ctx.host.k[layer]
        keys_host = K.flat_rows(k_host, self.bounds.host_ids.to(k_host.device)).to(k_dev.device)
        return slots, K.flat_rows(k_dev, row_ids), keys_host

    def row(self, ctx: KvEvictContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' slots `[B, W]` and their rows in the device pool's flat view `[B, H, W]`, read at the
        step's first layer and kept for the others (an exchange moves entries between slots, not slots).
        Read in the forward, not when planned: under the overlap scheduler the row may change between the
        two."""
        if self.row_read is None:
            buf = self.buf
            # the first W columns, then the batch's rows: a whole row of the table is the context length
            slots = ctx.rt.req_to_token[:, : self.width].index_select(0, buf.rows).to(torch.int64)
            self.row_read = (slots, slots.unsqueeze(1) * buf.heads.numel() + buf.heads.view(1, -1, 1))
        return self.row_read

    def _record(self, layer: int, ex: Exchange) -> None:
        for buf, x in zip((self.pos, self.hidx, self.dev_slots, self.host_cols, self.moved), ex, strict=True):
            buf[layer].copy_(x)
        self.layers_done = layer + 1

    def undo(self, ctx: KvEvictContext) -> None:
        """Swap back what the layers so far exchanged, newest first (a swap is its own inverse)."""
        for layer in reversed(range(self.layers_done)):
            _swap(ctx, layer, self.dev_slots[layer], self.host_cols[layer])
        self.layers_done = 0

    def undo_row(self, ctx: KvEvictContext, i: int) -> None:
        """Swap back batch row `i`'s exchanges and forget its arm: the overlap scheduler ran this step for
        a request that had already finished (found only once the step was launched), and without overlap
        that step never exists. Device ops only, ordered after the step on its stream."""
        for layer in reversed(range(self.layers_done)):
            _swap(ctx, layer, self.dev_slots[layer, i : i + 1], self.host_cols[layer, i : i + 1])
        self.moved[:, i].zero_()
        self.arms[i] = None


def fused_on_cpu(k_dev: torch.Tensor) -> bool:
    """Whether a layer runs `kernels.recall_layer_cpu` (a bf16 pool on a CPU, numba present) rather than
    `choose` and `_swap`; `KVEVICT_RECALL_KERNEL=torch` keeps the torch form (to compare the two)."""
    return os.environ.get("KVEVICT_RECALL_KERNEL", "") != "torch" and K.recall_layer_cpu_supports(k_dev)


def _swap(ctx: KvEvictContext, layer: int, dev_slots: torch.Tensor, host_cols: torch.Tensor) -> None:
    """Exchange the batch's pairs `dev_slots` <-> `host_cols` (`[B, H, R]`) at `layer`: one
    `kernels.host_swap` call with the batch folded into the pairs of each KV head."""
    rt, pool = ctx.rt, ctx.host
    b, h, r = dev_slots.shape
    pairs = [x.transpose(0, 1).reshape(1, h, b * r) for x in (dev_slots, host_cols)]
    kv = [rt.k_buffer(layer)], [rt.v_buffer(layer)]
    K.host_swap(*kv, pairs[0], pool.k[layer : layer + 1], pool.v[layer : layer + 1], pairs[1])


def arm(req: Any, s: st.ReqState, lo: int, hi: int, r: int) -> None:
    """Arm the request's recall for its next decode step (the scheduler, before the step)."""
    row = req.kv.req_pool_idx
    tokens = s.slot_map.tokens_for(int(req.kv.kv_committed_len))
    s.ctx.decode_armed[row] = DecodeArm(s, lo, hi, r, tokens, s.recall.host.cols.clone())
    s.ctx.host.in_use[row] = s.recall.host  # the LRU must not take what the step reads and writes


def plan(ctx: KvEvictContext, reqs: list[Any]) -> StepPlan | None:
    """The batch's `StepPlan` for its next decode forward, from the arms of its requests (in batch
    order); None when none of them is armed. Consumes the arms."""
    armed = ctx.decode_armed
    rows = [r.kv.req_pool_idx for r in reqs]
    arms = [armed.pop(row, None) if row is not None else None for row in rows]
    if not any(arms):
        return None
    rt, pool, tuning = ctx.rt, ctx.host, ctx.settings.recall
    lens = [int(r.kv.kv_committed_len) for r in reqs]
    live = [a for a in arms if a is not None]
    width = bucket(max(max(lens), max(a.hi for a in live)), cap=int(rt.req_to_token.shape[1]))
    n_cols = bucket(max(int(a.cols.numel()) for a in live))
    swaps = max(a.r for a in live)
    width = max(width, swaps)
    cols = torch.full((len(reqs), n_cols), pool.scratch, dtype=torch.int64)
    for i, a in enumerate(arms):
        if a is not None:
            cols[i, : a.cols.numel()] = a.cols
    per_row = [
        [row if row is not None else 0, n, *((a.lo, a.hi, a.r, a.cols.numel()) if a else (0, 0, 0, 0))]
        for row, n, a in zip(rows, lens, arms, strict=True)
    ]
    buf = buffers(ctx, (len(reqs), width, n_cols, swaps))
    inputs = (buf.rows, buf.m, buf.lo, buf.hi, buf.r, buf.n_cols)
    for dst, src in zip(inputs, torch.tensor(per_row, dtype=torch.int64).T, strict=True):
        dst.copy_(src)
    buf.cols.copy_(cols.unsqueeze(1))
    buf.derive()
    bounds = StepBounds(
        buf.pad,
        buf.not_host,
        buf.fixed,
        buf.first_r,
        buf.cols,
        buf.host_ids,
        tuning.page,
        swaps,
        recall_core.MIN_SCORE,
        pool.scratch,
    )
    return StepPlan(
        arms=arms,
        buf=buf,
        bounds=bounds,
        width=width,
        row_ids=[row if row is not None else -1 for row in rows],
        fused=fused_on_cpu(rt.k_buffer(0)),
    )


def finish(ctx: KvEvictContext, one: StepPlan) -> int:
    """After the step: the records become each recalling request's counters and the logical positions
    its row and host entries hold; the branch's page summaries and the moved slots' statistics are stale.
    The step's hold on its branches' host entries ends, unless a later step in flight armed the same row.
    Returns the entries swapped in, over the batch."""
    later = {
        row
        for p in ctx.steps_in_flight
        if p is not None
        for row, a in zip(p.row_ids, p.arms, strict=True)
        if a
    }
    for row, a in zip(one.row_ids, one.arms, strict=True):
        if a is not None and row not in later:
            ctx.host.in_use.pop(row, None)
    if one.failed or one.layers_done == 0:
        return 0
    done, pool = one.layers_done, ctx.host
    mark_stale(ctx.stats, 0, one.dev_slots[:done], one.moved[:done])  # before a compression reads them
    pool.totals.decode_steps += 1
    pool.totals.decode_steps_overlapped += one.overlapped
    counts = one.moved[:done].sum(dim=(0, 2, 3)).tolist()  # the one host read of the step's recall
    real = sum(int(a.cols.numel()) for a in one.arms if a is not None)
    pool.totals.keys_read += real * pool.heads * pool.dim * pool.k.element_size() * done  # every layer scored
    total = 0
    for i, a in enumerate(one.arms):
        if a is None or a.s.recall.host is None:
            continue
        n = int(counts[i])
        total += n
        if n:
            a.s.recall.host.summaries = None
        if a.s.recall.host.positions is not None:
            _positions(a, one, i, done)
        account(a.s, n)
    return total


def _positions(a: DecodeArm, one: StepPlan, i: int, layers: int) -> None:
    """The moved pairs of batch row `i` exchange their logical positions (row and host), from the step's
    records, all layers and KV heads at once; under KVEVICT_DEBUG the row's positions also become a
    timeline event (the oracle replays it)."""
    tracked = SwapPositions(a.s, int(one.buf.m[i]), a.s.recall.host)
    moved, pos, hidx = (x[:layers, i].cpu() for x in (one.moved, one.pos, one.hidx))
    tracked.apply(0, pos, hidx, moved)
    tracked.record(a.s, a.tokens)


def fail(ctx: KvEvictContext, one: StepPlan) -> None:
    """A failure inside the step: what it swapped goes back, and its requests recall alone from then on
    (after their compressions, one by one), so a failure that one request's data causes stays its own.
    Logged by the caller, counted once here."""
    try:
        one.undo(ctx)
    except Exception:
        logger.exception("kvevict: undoing a failed decode-step recall failed")
    one.failed = True
    ctx.host.totals.recall_failures += 1
    for a in one.arms:
        if a is not None:
            if a.s.recall.host is not None:
                a.s.recall.host.summaries = None
            a.s.recall.alone = True
            a.s.recall.due = True
