"""The host tier and recall: its bounds, its measured defaults and its tuning knobs (`RecallTuning`).

`--kv-recall-tokens` turns the tier on, `--kv-host-tokens` / `--kv-host-gib` size it and `--kv-recall-config`
tunes it; every default here was measured (the comments say where).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_RECALL_TOKENS = 4096  # bound on --kv-recall-tokens and a request's recall_tokens (per layer and head)
MAX_HOST_TOKENS = 1 << 21  # bound on --kv-host-tokens (host columns)
MIN_HOST_GIB, MAX_HOST_GIB = 0.001, 4096.0  # bounds on --kv-host-gib (per rank; then checked in columns too)
DEFAULT_HOST_TOKENS = 16384
MAX_RECALL_PAGE = 256  # bound on the recall page (host columns per page)
MAX_RECALL_EVERY = 4096  # bound on recall every (decode steps)
MAX_RECALL_FETCH_PAGES = 4096  # bound on recall fetch_pages (pages per layer and KV head)
MAX_RECALL_SEGMENTS = 64  # bound on recall segments (per turn)
MAX_RECALL_SEGMENT_TOKENS = 1024  # bound on recall segment_tokens (logical positions)
# Recall by default brings whole segments back at each turn's start and none in decode steps (`every` 0):
# a decode forward then runs SGLang's attention only, what CUDA graphs and the overlap scheduler run. On
# the recall scenarios it answers as the full cache does (docs/benchmarks.md, "Which route").
DEFAULT_RECALL_SEGMENTS = 2
DEFAULT_RECALL_SEGMENT_TOKENS = 16  # by contrast, the fact's 16 positions rank in the top two (measured)
DEFAULT_RECALL_PAGE = 8
# A recall picks among the pages its summaries rank best: in a history of hundreds of pages, 64 candidate
# pages per layer and head found 7 of 12 planted facts where 8 (16 for a turn's R) found 2, and scoring
# every key 6 (the long recall replay, 225 pages per layer and head); a decode step then reads 64 pages.
DEFAULT_RECALL_FETCH_PAGES = 64
DEFAULT_RECALL_EVERY = 0  # a decode step's recall is a setting: eager decode only, 1.08x its time
# A host page comes back only where a query gives its best entry at least this much attention: weaker
# evidence swapped entries back and forth (3-5x the bytes moved) and answered no better (measured).
DEFAULT_RECALL_MIN_SCORE = 0.05
# A decode step recalls only in the (layer, KV head) pairs whose induction score reaches this
# (`cache/retrieval_heads.py`): SmolLM2-135M has 10 of 90, and recalling in them alone answered within
# one of recalling in every head, per policy, on the long recall scenario, for 1.08x decode, not 1.36x (measured).
DEFAULT_RECALL_HEAD_SCORE = 0.1


class RecallTuning(BaseModel):
    """The host tier's tuning knobs: the `--kv-recall-config` setting (each has a measured default)."""

    model_config = ConfigDict(extra="forbid")

    page: int = Field(
        DEFAULT_RECALL_PAGE,
        ge=1,
        le=MAX_RECALL_PAGE,
        description="host columns per recall page: an entry is ranked by the best entry of its page, so a "
        "recall brings an attended token's neighbours with it",
    )
    summary: Literal["minmax", "mean", "off"] = Field(
        "minmax",
        description="how a turn's recall finds the host entries it needs: score per-page key summaries, then "
        "fetch only the best pages' columns (minmax: per-channel key bounds; mean: the mean key, half the "
        "bytes), or off: score every host key (a decode step's recall always does)",
    )
    fetch_pages: int = Field(
        DEFAULT_RECALL_FETCH_PAGES,
        ge=1,
        le=MAX_RECALL_FETCH_PAGES,
        description="pages a turn's paged recall fetches at least, per layer and KV head, chosen by their summaries "
        "(it fetches 2R/page when that is more): the host keys a recall reads besides the summaries",
    )
    append: Literal["on", "off"] = Field(
        "on",
        description="after each turn's prefill, bring the turn's best host entries back into up to R fresh "
        "slots appended to the row, displacing nothing; the turn decodes over its budget plus them, and "
        "its next compression folds them back",
    )
    prefill: Literal["both", "swap"] = Field(
        "both",
        description="both: each turn's prefill attends over the branch's device and host entries (the full "
        "cache's prefill: its compression and append then rank with the full cache's queries), reading "
        "the host entries once per layer; swap: its queries swap host entries into the row layer by "
        "layer and it attends over the row only",
    )
    segments: int = Field(
        DEFAULT_RECALL_SEGMENTS,
        ge=0,
        le=MAX_RECALL_SEGMENTS,
        description="the append brings back these whole segments of the branch's history first, in every layer "
        "and KV head: those the turn's queries attend more than the branch's previous turn did, summed over "
        "layers and KV heads, each with the segment after it (with prefill both, which scores them); 0: "
        "entries ranked one by one only",
    )
    segment_tokens: int = Field(
        DEFAULT_RECALL_SEGMENT_TOKENS,
        ge=1,
        le=MAX_RECALL_SEGMENT_TOKENS,
        description="logical positions per segment",
    )
    every: int = Field(
        DEFAULT_RECALL_EVERY,
        ge=0,
        le=MAX_RECALL_EVERY,
        description="decode steps between recalls, each by its step's own query inside the step's forward "
        "(eager decode: a CUDA graph replays none); 0: only at each turn's start",
    )
    head_score: float = Field(
        DEFAULT_RECALL_HEAD_SCORE,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="a decode step recalls only in the model's retrieval heads: the (layer, KV head) pairs "
        "whose induction score (the attention a repeated token gives what followed its first occurrence, "
        "measured once per model) is at least this; 0: every head",
    )
    min_score: float = Field(
        DEFAULT_RECALL_MIN_SCORE,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="the least attention probability a query must give a host page's best entry for the page "
        "to come back (and it must beat the entry it displaces); 0: beating it is enough",
    )
