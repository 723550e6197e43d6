"""Segments: what a turn's append brings back first is whole stretches of the branch's history, chosen by
every layer and KV head at once.

Why: ranked entry by entry, each (layer, KV head) brings back what its own queries match, and the words
a question shares with every earlier turn ("What is the ...? Answer ...") match the filler turns'
questions in most heads; the planted fact wins in a few heads only, and decode then needs a recall
inside every step to find the rest. Brought back whole, in every layer and head, the fact's stretch is
there for decode to copy from with no recall of its own.

Which stretch: raw attention summed over heads favours what every turn attends to: the chat template,
the previous answer (recency), the earlier questions' wording. So a segment ranks by contrast: how much
more this turn attends to its positions than the branch's previous scored turn did (its `habit`, kept
with the branch's host entries). What both turns draw cancels; what only this question looks up stands
out. An offline check with the full model's attention (fp32, HF), the 16 positions holding the fact
ranked: summed raw over the retrieval heads, first in 19 of the full cache's 33 answered short sessions;
by contrast over every head, first in 28 and within the top two in all 33, and within the top two in
all 8 long-scenario sessions the full cache answers.

How: while a turn's prefill attends over both tiers (`exact_prefill`, so its attention is the full
cache's), each entry's best attention (over the turn's queries and the KV head's query heads; device,
host and the chunk's own entries alike) is added to its logical position's score (`add`). A turn whose
branch holds nothing on the host yet is scored too when it may evict (`trigger.may_fire`), so the first
turn that recalls has a habit. The append takes the contrast with the habit (`contrast`; the scores
become the next turn's habit), picks the `segments` segments of `segment_tokens` positions whose best
position stands out most, each with the segment after it (what follows an attended token is what an
answer copies: a code's last digits; `choose`), and ranks their host entries first in every layer and
head (`members`); the rest of its `R` entries per layer and head are ranked one by one as before, and so
are all of them in a branch's first scored turn (no habit). Logical positions of host entries are
tracked whenever segments are on (`state.tracks_positions`).
"""

from __future__ import annotations

import torch

SINKS = 4  # the first positions every query attends to by habit: never evidence of a segment


def add(
    scores: torch.Tensor | None, positions: torch.Tensor, best: torch.Tensor, tokens: int
) -> torch.Tensor:
    """`scores` (`[tokens]`, fp32, or None to start; grown to `tokens`, which is past every position)
    plus each entry's `best` attention (`[H, C]`) at its logical position (`positions` `[H, C]`)."""
    if scores is None or scores.numel() < tokens:
        grown = torch.zeros(tokens, dtype=torch.float32, device=best.device)
        if scores is not None:
            grown[: scores.numel()] = scores
        scores = grown
    at = positions.to(device=best.device, dtype=torch.int64).reshape(-1)
    return scores.index_add_(0, at, best.float().reshape(-1))


def contrast(scores: torch.Tensor, habit: torch.Tensor) -> torch.Tensor:
    """What this turn attends to more than the branch's previous scored turn did (`habit`, its own
    scores, same positions), never below 0: a turn's template and the words every question shares draw
    both turns alike and cancel; what only this turn looks up stands out. Positions past the habit (the
    previous turn's answer) have no baseline: drawn by recency, their attention is no evidence (0)."""
    n = min(scores.numel(), habit.numel())
    out = torch.zeros_like(scores)
    out[:n] = (scores[:n] - habit[:n].to(scores)).clamp_min(0)
    return out


def choose(scores: torch.Tensor, size: int, count: int) -> torch.Tensor:
    """`[n]` bool over the segments of `size` positions: the `count` whose best position scores most
    (sinks excluded), each with the one after it."""
    s = scores.clone()
    s[:SINKS] = 0
    n = -(-s.numel() // size)
    best = torch.nn.functional.pad(s, (0, n * size - s.numel())).view(n, size).amax(-1)
    top = best.topk(min(count, n)).indices
    real = (best[top] > 0).float()  # nothing attended there: not a choice
    votes = torch.zeros(n, device=s.device).index_add_(0, top, real)
    votes.index_add_(0, (top + 1).clamp(max=n - 1), real)
    return votes > 0


def members(positions: torch.Tensor, chosen: torch.Tensor, size: int) -> torch.Tensor:
    """`[L, H, C]` bool: the host entries (logical `positions` `[L, H, C]`) inside a chosen segment.
    Entries past the scored positions (the turn's own, demoted by the compression after its prefill)
    were never scored: none of them is a member."""
    seg = positions.to(chosen.device, torch.int64) // size
    return chosen[seg.clamp(max=chosen.numel() - 1)] & (seg < chosen.numel())
