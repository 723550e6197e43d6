"""Deterministic filler text of an exact token length (tests and single-request benchmarks)."""

from __future__ import annotations

import random

from transformers import PreTrainedTokenizerBase

_WORDS = (
    "river stone lantern orchard copper meadow signal harbor quiet amber forest engine ledger "
    "violet canyon marble thunder candle garden silver rocket window basket pepper island"
).split()


def log_text(tokenizer: PreTrainedTokenizerBase, n_tokens: int, seed: int = 0) -> str:
    """A worker log of exactly `n_tokens` tokens (before any chat template), the same for the same seed."""
    rng = random.Random(seed)
    lines: list[str] = []
    text = ""
    while len(tokenizer.encode(text)) < n_tokens:
        for _ in range(20):
            w = rng.sample(_WORDS, 3)
            status = rng.choice(["ok", "retry", "done"])
            lines.append(
                f"[{len(lines):04d}] worker-{rng.randint(1, 9)} moved the {w[0]} {w[1]} to the {w[2]} (status {status})."
            )
        text = "\n".join(lines)
    return tokenizer.decode(tokenizer.encode(text)[:n_tokens])
