"""The host tier and recall: its bounds, its measured defaults and its tuning knobs (`RecallTuning`).

`--kv-recall-tokens` turns the tier on, `--kv-host-tokens` / `--kv-host-gib` size it and `--kv-recall-config`
tunes it; every default here was measured (the comments say where).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_RECALL_TOKENS = 4096  # bound on --kv-recall-tokens and a request's recall_tokens (per layer and head)
MAX_HOST_TOKENS = 1 << 21  # bound on --kv-host-tokens (host columns)
MIN_HOST_GIB, MAX_HOST_GIB = 0.001, 4096.0  # bounds on --kv-host-gib (per rank; then checked in columns too)
# Without a size the host tier holds twice the device KV pool's tokens, as SGLang's HiCache sizes its host
# pool (`--hicache-ratio` 2), and at most a quarter of the machine's RAM: on the recall suite's LoCoMo
# family a fixed 16,384 columns (about a quarter of the pool) lost histories to the LRU, so recall had
# nothing to bring back (docs/benchmarks.md, "Host tier and recall").
HOST_POOL_RATIO = 2
HOST_RAM_SHARE = 0.25
MAX_RECALL_PAGE = 256  # bound on the recall page (host columns per page)
MAX_RECALL_EVERY = 4096  # bound on recall every (decode steps)
DEFAULT_RECALL_PAGE = 8
# Every decode step recalls by its own query: on the recall suite's client-composed history it answered
# 10-11 of 12 where recall at each turn's start only answered 4-7 (docs/benchmarks.md, "Host tier and recall").
# It recalls in every (layer, KV head) pair: in the model's retrieval heads alone it answered fewer
# (docs/design-notes.md, "Recall (host tier)").
DEFAULT_RECALL_EVERY = 1


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
    every: int = Field(
        DEFAULT_RECALL_EVERY,
        ge=1,
        le=MAX_RECALL_EVERY,
        description="decode steps between recalls, each by its step's own query, in every layer and KV head, "
        "inside the step's forward "
        "(eager decode; where a CUDA graph replays the step, after its compression instead)",
    )
