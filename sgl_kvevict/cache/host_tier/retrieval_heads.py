"""Which (layer, KV head) pairs a decode step's recall runs in: the model's retrieval heads.

Why: a decode step ranks host entries by the step's own query, per layer and KV head. Most heads do not
read far back; there the host entries a query scores best match its generic part (a template, the
filler turns' question) and bringing them back only costs. A few heads copy from far back: given a
token, they attend to what followed its earlier occurrence (induction, or retrieval, heads). On the
long recall scenario, a decode step recalling in those heads only answered within one of recalling in
every head, per policy (`docs/benchmarks.md`), for a fraction of the step's work.

The score is the model's, not a request's: random tokens repeated twice, and a head's score is the
attention a token of the second copy gives the token after its first occurrence (mean over the copy and
over a few seeds; a KV head takes the best of its query heads). It is computed once per model with HF
transformers on the CPU (eager attention) and cached on disk (`cached_scores`; the server keeps it under
the project's cache folder, `python -m sgl_kvevict.tools.heads` prints it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("sgl_kvevict")

CACHE_FOLDER = "retrieval-heads"  # under the project's cache folder: one file per model
COPY_TOKENS = 200  # random tokens per copy
SEEDS = 4
FORMAT = 1  # bump when the score's recipe changes (the cache key includes it)


def induction_scores(
    model_path: str | Path, copy_tokens: int = COPY_TOKENS, seeds: int = SEEDS
) -> torch.Tensor:
    """`[layers, KV heads]` in [0, 1]: how much each KV head's best query head copies from an earlier
    occurrence (see the module)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cfg = model.config
    q_heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    acc = torch.zeros(int(cfg.num_hidden_layers), q_heads)
    second = torch.arange(copy_tokens + 1, 2 * copy_tokens)  # the second copy (after BOS and the first)
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        # ids far from both ends of the vocabulary: no special tokens
        seg = torch.randint(1000, int(cfg.vocab_size) - 1000, (copy_tokens,), generator=gen)
        bos = int(cfg.bos_token_id if cfg.bos_token_id is not None else seg[0])
        ids = torch.cat([torch.tensor([bos]), seg, seg]).unsqueeze(0)
        with torch.no_grad():
            out = model(ids, output_attentions=True)
        for layer, att in enumerate(out.attentions):  # [1, Hq, T, T]
            acc[layer] += att[0][:, second, second - copy_tokens + 1].mean(-1)
    acc /= seeds
    return acc.view(acc.shape[0], kv_heads, q_heads // kv_heads).amax(-1)


def _cache_file(model_path: Path, cache_dir: Path) -> Path:
    """One file per model: its resolved path and its config.json's bytes (another model, or the same
    path with other weights' config, gets another file)."""
    h = hashlib.sha256(str(model_path.resolve()).encode())
    conf = model_path / "config.json"
    if conf.exists():
        h.update(conf.read_bytes())
    h.update(f"format {FORMAT} {COPY_TOKENS} {SEEDS}".encode())
    return cache_dir / f"{h.hexdigest()[:20]}.json"


def cached_scores(model_path: str | Path, cache_dir: Path) -> torch.Tensor:
    """`induction_scores` of the model, computed once and kept in `cache_dir`."""
    path = Path(model_path)
    out = _cache_file(path, cache_dir)
    if out.exists():
        return torch.tensor(json.loads(out.read_text())["kv_heads"])
    logger.info("sgl-kvevict: measuring the retrieval heads of %s (once per model)", path)
    scores = induction_scores(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")  # servers starting together each write their own
    tmp.write_text(json.dumps({"model": str(path), "kv_heads": scores.tolist()}))
    tmp.replace(out)
    return scores


def mask(scores: torch.Tensor, min_score: float, tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
    """`[layers, this rank's KV heads]`: the heads whose score is at least `min_score` (a rank holds the
    `tp_rank`-th slice of the KV heads)."""
    per = scores.shape[1] // tp_size
    return scores[:, tp_rank * per : (tp_rank + 1) * per] >= min_score


@dataclass(frozen=True)
class RecallHeads:
    """Where a decode step recalls: `mask` `[layers, KV heads]` (bool, on the KV device) and the layers
    with at least one such head (read once, at start: the step never reads the mask back)."""

    mask: torch.Tensor
    layers: frozenset[int]

    @classmethod
    def of(cls, mask: torch.Tensor, device: torch.device | str) -> RecallHeads:
        layers = frozenset(int(i) for i in mask.any(dim=-1).nonzero().flatten().tolist())
        return cls(mask.to(device), layers)


def scores_at(heads: RecallHeads | None, layer: int) -> bool:
    """Whether a decode step's recall scores at `layer`: a layer with a retrieval head (None: every layer)."""
    return heads is None or layer in heads.layers
