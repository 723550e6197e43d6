"""Print a model's induction score per (layer, KV head), the retrieval heads a decode step recalls in
(`sgl_kvevict/cache/host_tier/retrieval_heads.py`), measuring it first when the server has not:

    python -m sgl_kvevict.tools.heads [--model-path PATH] [--min-score S]
"""

from __future__ import annotations

import argparse
import sys

from sgl_kvevict.cache.host_tier import retrieval_heads
from sgl_kvevict.config import DEFAULT_RECALL_HEAD_SCORE
from sgl_kvevict.model import cache_root, default_model_path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="the induction score of each (layer, KV head) of a model")
    ap.add_argument("--model-path", default=None, help="an HF folder (default: the embedded SmolLM2)")
    ap.add_argument(
        "--min-score", type=float, default=DEFAULT_RECALL_HEAD_SCORE, help="count the heads at or above this"
    )
    args = ap.parse_args(argv)
    path = args.model_path or default_model_path()
    scores = retrieval_heads.cached_scores(path, cache_root() / retrieval_heads.CACHE_FOLDER)
    for layer, row in enumerate(scores.tolist()):
        print(f"layer {layer:3d}: " + " ".join(f"{x:.2f}" for x in row))
    n = int((scores >= args.min_score).sum())
    print(f"{n} of {scores.numel()} (layer, KV head) pairs score >= {args.min_score}", file=sys.stderr)


if __name__ == "__main__":
    main()
