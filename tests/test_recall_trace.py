"""`benchmarks/recall_trace.py`'s reading of a kept timeline (pure list math; the timelines themselves
come from a KVEVICT_DEBUG server, which `tests/test_recall_e2e.py` checks)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import recall_trace as rt  # noqa: E402


class _Tok:
    """Characters as tokens: enough to find a value and print a run."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_the_trace_counts_the_value_and_finds_the_append() -> None:
    tok = _Tok()
    prompt = tok.encode("code is 42; again 42.")
    pos = rt.value_positions(tok, prompt, "42")
    assert pos == [7, 8, 9, 17, 18, 19]  # " 42" twice
    two = lambda *ps: [[list(ps), list(ps)]]  # noqa: E731 (1 layer, 2 KV heads)
    timeline = [
        {"tokens": 21, "positions": two(0, 1, 2)},  # compressed
        {"tokens": 21, "positions": two(*range(21))},  # the prefill over both tiers sees everything
        {"tokens": 21, "positions": two(0, 1, 2)},
        {"tokens": 21, "positions": two(0, 1, 2, 8, 9)},  # the append: " 42"'s digits come back
        {"tokens": 22, "positions": two(0, 1, 2, 8, 9, 18)},
    ]
    assert [rt.held(ev, pos) for ev in timeline] == [0, 12, 0, 4, 6]
    text = rt.report({"session": "s", "value": "42", "answer": "42", "positions": pos,
                      "timeline": timeline, "prompt": prompt, "tok": tok})  # fmt: skip
    assert "| 3 | 21 | 5 | 4 of 12 |" in text
    assert "(event 3): 8-9 '42'" in text
