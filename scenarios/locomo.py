"""Real multi-session conversations: LoCoMo (snap-research/locomo, `data/locomo10.json` or the folder of
its ten per-conversation files), scored by the dataset's own measure, token F1 against its answer.

The dataset is not shipped: pass its path (`--scenario-path`). Its ten conversations are numbered 1-10
in the dataset's order (by sample id: 26, 30, 41-44, 47-50). **Conversations 1-5 are held out** for
acceptance: this loader refuses them unless `KVEVICT_LOCOMO_HELD_OUT=1` is set, so that no design is
tuned on them by accident.

Each conversation is replayed as a client-composed history: its dated sessions in order, each one user
message with the dialog and a one-line reply the client wrote, until about `filler_tokens * turns`
characters/4 tokens of dialog (`windows` > 1: the next stretch of as many, a session of its own, and so
on); then up to `questions` of the dataset's questions whose evidence lies in that history (categories
1-4: single-hop, multi-hop, temporal, open-domain; 5, the adversarial ones with no answer, is skipped)
are asked at once, each as a branch off the stored history.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections import Counter
from pathlib import Path
from typing import Any

from .base import CHARS_PER_TOKEN, Message, Scenario, ScenarioConfig, Session, Turn

HELD_OUT = range(1, 6)
ASK = "Based on the conversation above, answer in a few words. {q}"


def conversation_numbers(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    bad = [n for n in out if not 1 <= n <= 10]
    if bad:
        raise ValueError(f"locomo has conversations 1-10, got {bad}")
    held = [n for n in out if n in HELD_OUT]
    if held and os.environ.get("KVEVICT_LOCOMO_HELD_OUT") != "1":
        raise ValueError(
            f"locomo conversations {held} are held out for acceptance; design on 6-10 "
            "(set KVEVICT_LOCOMO_HELD_OUT=1 only for the acceptance run)"
        )
    return out


def load(path: str | Path) -> list[dict[str, Any]]:
    """The ten conversations in the dataset's order (sorted by sample id)."""
    p = Path(path)
    if p.is_dir():
        items = [json.loads(f.read_text()) | {"sample_id": f.stem} for f in p.glob("*.json")]
    else:
        items = json.loads(p.read_text())
    key = [int(re.sub(r"\D", "", str(it.get("sample_id", i))) or i) for i, it in enumerate(items)]
    items = [it for _, it in sorted(zip(key, items, strict=True), key=lambda x: x[0])]
    if len(items) != 10:
        raise ValueError(f"{path}: expected LoCoMo's 10 conversations, found {len(items)}")
    return items


def _sessions(conv: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    src = conv.get("conversation", conv)
    n = sorted(int(k.split("_")[1]) for k in src if re.fullmatch(r"session_\d+", k))
    return [(src.get(f"session_{k}_date_time", ""), src[f"session_{k}"]) for k in n]


def _windows(conv: dict[str, Any], budget_chars: float, n: int) -> list[tuple[list[Turn], set[str]]]:
    """Up to `n` consecutive stretches of the conversation's dated sessions, each about `budget_chars` of
    dialog (at least one session): each one user message per session with a one-line reply the client
    wrote, and the dialog ids it holds."""
    out: list[tuple[list[Turn], set[str]]] = []
    turns: list[Turn] = []
    seen: set[str] = set()
    size = 0.0
    for date, dialog in _sessions(conv):
        lines = [f"{d['speaker']}: {d['text']}" for d in dialog if d.get("text")]
        text = f"Chat on {date}:\n" + "\n".join(lines)
        if turns and size + len(text) > budget_chars:
            out.append((turns, seen))
            if len(out) == n:
                return out
            turns, seen, size = [], set(), 0.0
        size += len(text)
        seen |= {d["dia_id"] for d in dialog}
        turns.append(Turn(inputs=[Message(role="user", content=text)], reply="Noted."))
    if turns:  # the conversation ended inside a stretch (fewer than `n` were full)
        out.append((turns, seen))
    return out


def build(cfg: ScenarioConfig) -> Scenario:
    if not cfg.path:
        raise ValueError("the locomo scenario needs --scenario-path (LoCoMo's locomo10.json or its folder)")
    data = load(cfg.path)
    budget_chars = cfg.filler_tokens * cfg.turns * CHARS_PER_TOKEN
    sessions = []
    for n in conversation_numbers(cfg.conversations):
        conv = data[n - 1]
        for w, (turns, seen) in enumerate(_windows(conv, budget_chars, cfg.windows)):
            qa = [
                q
                for q in conv["qa"]
                if q.get("category") in (1, 2, 3, 4)
                and "answer" in q
                and q.get("evidence")
                and all(e.strip() in seen for e in q["evidence"])
            ][: cfg.questions]
            if not qa:
                continue
            branches = [[Message(role="user", content=ASK.format(q=q["question"]))] for q in qa]
            turns.append(
                Turn(
                    inputs=[], branches=branches, references=[str(q["answer"]) for q in qa], max_new_tokens=24
                )
            )
            sid = f"locomo-{n}" if w == 0 else f"locomo-{n}-{w + 1}"  # the first window keeps its old id
            sessions.append(Session(id=sid, kind="locomo", turns=turns))
    return Scenario(name="locomo", seed=cfg.seed, sessions=sessions)


def normalize(text: str) -> list[str]:
    """Lower case, no punctuation, no articles, split on spaces (SQuAD's normalization, which LoCoMo's
    scorer builds on; it also stems, which this does not)."""
    text = text.lower().replace(",", "")
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return text.split()


def f1(answer: str, reference: str) -> float:
    """Token F1 of an answer against the reference."""
    pred, gold = normalize(answer), normalize(reference)
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if not pred or not gold or same == 0:
        return 0.0
    p, r = same / len(pred), same / len(gold)
    return 2 * p * r / (p + r)
