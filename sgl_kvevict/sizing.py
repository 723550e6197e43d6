"""Memory the plugin reserves beside SGLang's own KV pool, in bytes, for a model's shape.

- the **host tier** (`--kv-recall-tokens`): `columns` columns, each one evicted entry of every layer and KV
  head, K and V (`cache/host_tier/host.py`), in host memory (pinned on a GPU); by default twice the device
  KV pool's tokens, at most a quarter of the RAM (`default_columns`);
- the **window-query capture buffer** (attention-based policies, or recall): `(slots + 1) x layers x
  (window + 1) x query heads x head dim` in the model's dtype, on the device (`cache/capture.py`);
- the **page summaries** recall scores host pages with (`kernels/page_scores.py`): per page of `page` host
  columns, the per-channel min and max key, `[pages, layers, KV heads, head dim]` each, in the KV dtype, on the device; built for the columns the host tier
  holds, so at most about `columns / page` pages (plus one partial page per branch).

`--kv-host-gib` is turned into columns here (`columns_for_bytes`). Under tensor parallelism each rank
holds its own share of the KV heads, so every figure is per rank.

    python -m sgl_kvevict.sizing            # the table of docs/deployment.md
    python -m sgl_kvevict.sizing --model-path <folder with config.json> [--host-tokens N | --host-gib G]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from sgl_kvevict.config import (
    DEFAULT_CAPTURE_SLOTS,
    DEFAULT_RECALL_PAGE,
    HOST_POOL_RATIO,
    HOST_RAM_SHARE,
    MAX_HOST_TOKENS,
)
from sgl_kvevict.policies.base import PolicyConfig

GIB = 1 << 30
MIB = 1 << 20
TABLE_POOL_TOKENS = 65536  # the device pool the docs' table sizes the default host tier for
TABLE_HOST_COLUMNS = HOST_POOL_RATIO * TABLE_POOL_TOKENS  # that pool's default host tier
DEFAULT_WINDOW = PolicyConfig.model_fields["window"].default
_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


@dataclass(frozen=True)
class Shape:
    """What the sizes depend on: one rank's share of a model's attention."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16

    @property
    def column_bytes(self) -> int:
        """One host column: K and V of one token in every layer and KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


# The models of the sizing table in docs/deployment.md: their published config.json values (bf16).
# SmolLM2-135M is the embedded model (`sgl_kvevict/model.py`); the Llama shapes are Meta's Llama-3.1
# configs (`num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `hidden_size / heads`).
MODELS = (
    Shape("SmolLM2-135M", layers=30, q_heads=9, kv_heads=3, head_dim=64),
    Shape("Llama-3.1-8B", layers=32, q_heads=32, kv_heads=8, head_dim=128),
    Shape("Llama-3.1-70B", layers=80, q_heads=64, kv_heads=8, head_dim=128),
)


def shape_of(config: dict, tp_size: int = 1, kv_cache_dtype: str | None = None, name: str = "") -> Shape:
    """A model's `config.json` -> one rank's `Shape` (KV heads split over `tp_size`, at least one)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    q_heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or q_heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // q_heads)
    dtype = (
        kv_cache_dtype if kv_cache_dtype not in (None, "auto") else str(text.get("torch_dtype") or "bfloat16")
    )
    dtype_bytes = _DTYPE_BYTES.get(dtype.replace("torch.", ""), 1 if "fp8" in dtype else 2)
    tp = max(1, int(tp_size))
    return Shape(
        name or str(config.get("_name_or_path") or ""),
        int(text["num_hidden_layers"]),
        max(1, q_heads // tp),
        max(1, kv_heads // tp),
        head_dim,
        dtype_bytes,
    )


def host_bytes(shape: Shape, columns: int) -> int:
    return columns * shape.column_bytes


def capture_bytes(shape: Shape, slots: int = DEFAULT_CAPTURE_SLOTS, window: int = DEFAULT_WINDOW) -> int:
    """The window-query buffer as `capture.Store` allocates it (one spare slot and query each)."""
    return (slots + 1) * shape.layers * (window + 1) * shape.q_heads * shape.head_dim * shape.dtype_bytes


def summary_bytes(shape: Shape, columns: int, page: int = DEFAULT_RECALL_PAGE) -> int:
    """Page summaries of `columns` host columns on the device: each key channel's minimum and maximum."""
    return 2 * math.ceil(columns / page) * shape.layers * shape.kv_heads * shape.head_dim * shape.dtype_bytes


def columns_for_bytes(nbytes: float, shape: Shape, flag: str = "--kv-host-gib") -> int:
    """Host columns that fit in `nbytes`; ValueError naming the bound when that is under one column or
    over `MAX_HOST_TOKENS`."""
    cols = int(nbytes // shape.column_bytes)
    if not 1 <= cols <= MAX_HOST_TOKENS:
        lo, hi = shape.column_bytes / GIB, MAX_HOST_TOKENS * shape.column_bytes / GIB
        raise ValueError(
            f"{flag} {nbytes / GIB:g} is {cols} host columns of {shape.column_bytes} bytes for this model: "
            f"must be in [1, {MAX_HOST_TOKENS}] columns, i.e. [{lo:.6f}, {hi:.1f}] GiB"
        )
    return cols


def default_columns(pool_tokens: int, shape: Shape, ram_bytes: int | None) -> int:
    """The host tier's size when no flag gives one: `HOST_POOL_RATIO` times the device KV pool's tokens, at
    most `HOST_RAM_SHARE` of the machine's RAM (when known) and `MAX_HOST_TOKENS`; at least one column."""
    cols = min(HOST_POOL_RATIO * pool_tokens, MAX_HOST_TOKENS)
    if ram_bytes is not None:
        cols = min(cols, int(ram_bytes * HOST_RAM_SHARE // shape.column_bytes))
    return max(1, cols)


def _fmt(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def table(shapes: tuple[Shape, ...] = MODELS, columns: int = TABLE_HOST_COLUMNS) -> str:
    """The Markdown sizing table of docs/deployment.md."""
    lines = [
        f"| model (bf16) | layers x KV heads x head dim | one host column | host tier, {columns:,} columns "
        f"| capture buffer, {DEFAULT_CAPTURE_SLOTS} slots x {DEFAULT_WINDOW} queries "
        f"| page summaries on the device (minmax, page {DEFAULT_RECALL_PAGE}) |",
        "|---|---|---|---|---|---|",
    ]
    for s in shapes:
        lines.append(
            f"| {s.name} | {s.layers} x {s.kv_heads} x {s.head_dim} | {s.column_bytes / 1024:.0f} KiB "
            f"| {_fmt(host_bytes(s, columns))} | {_fmt(capture_bytes(s))} | {_fmt(summary_bytes(s, columns))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="a folder with config.json (default: the table's three models)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument(
        "--host-tokens",
        type=int,
        default=TABLE_HOST_COLUMNS,
        help="host columns (default %(default)s: the server's default for a device pool of "
        f"{TABLE_POOL_TOKENS} tokens)",
    )
    ap.add_argument("--host-gib", type=float, default=None, help="host tier in GiB instead of columns")
    args = ap.parse_args(argv)
    if args.model_path is None:
        print(table(columns=args.host_tokens))
        return 0
    cfg = json.loads((Path(args.model_path) / "config.json").read_text())
    shape = shape_of(cfg, args.tp_size, name=Path(args.model_path).name)
    columns = args.host_tokens
    if args.host_gib is not None:
        try:
            columns = columns_for_bytes(args.host_gib * GIB, shape)
        except ValueError as e:
            print(f"sizing: error: {e}", file=sys.stderr)
            return 2
    print(table((shape,), columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
