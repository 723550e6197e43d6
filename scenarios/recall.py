"""Recall chat: a fact (a code, a name or a number) is planted in the first turn, filler turns follow,
and the last turn asks for it; the answer must contain the exact value.

Kept easy on purpose (one clear statement, a direct question, a short answer) so that SmolLM2-135M gets
it right with a full cache: only then does a miss under compression measure what compression costs.
"""

from __future__ import annotations

import random

from .base import Message, Scenario, ScenarioConfig, Session, Turn, fill, rng_for

FIRST = ["Marta", "Tobias", "Ingrid", "Kenji", "Amara", "Lucas", "Priya", "Oskar"]
LAST = ["Quill", "Hale", "Brook", "Vance", "Moreau", "Okafor", "Lind", "Sato"]
TOPICS = [
    "gardening",
    "the history of trains",
    "baking bread",
    "ocean tides",
    "chess openings",
    "bird migration",
]
SENTENCES = [
    "Many people find {t} relaxing after a long day of work.",
    "The basics of {t} can be learned in a few weeks with practice.",
    "Experts in {t} often disagree about the best approach.",
    "Books about {t} are popular in small town libraries.",
    "A common mistake in {t} is to rush the early steps.",
    "Some schools now offer short courses on {t}.",
]


def _fact(r: random.Random) -> tuple[str, str, str]:
    """(statement, question, expected value)."""
    kind = r.choice(["code", "name", "number"])
    if kind == "code":
        v = str(r.randint(1000, 9999))
        return f"My locker code is {v}.", "What is my locker code? Answer with the code only.", v
    if kind == "name":
        v = f"{r.choice(FIRST)} {r.choice(LAST)}"
        return (
            f"My new manager is called {v}.",
            "What is the name of my new manager? Answer with the name only.",
            v,
        )
    v = str(r.randint(20, 990))
    return (
        f"The trip budget is {v} dollars.",
        "What is the trip budget in dollars? Answer with the number only.",
        v,
    )


def build(cfg: ScenarioConfig) -> Scenario:
    sessions = []
    for i in range(cfg.sessions):
        r = rng_for(cfg.seed, "recall", i)
        statement, question, value = _fact(r)
        turns = [
            Turn(
                inputs=[
                    Message(role="user", content=f"Please remember this: {statement} Just confirm briefly.")
                ]
            )
        ]
        for _ in range(max(0, cfg.turns - 2)):
            topic = r.choice(TOPICS)
            text = fill(r, cfg.filler_tokens, lambda r, t=topic: r.choice(SENTENCES).format(t=t))
            turns.append(
                Turn(
                    inputs=[
                        Message(
                            role="user",
                            content=f"Here is a note about {topic}:\n{text}\nSummarize it in one sentence.",
                        )
                    ]
                )
            )
        turns.append(Turn(inputs=[Message(role="user", content=question)], expect=value, max_new_tokens=16))
        sessions.append(Session(id=f"recall-{i}", kind="recall", turns=turns))
    return Scenario(name="recall", seed=cfg.seed, sessions=sessions)


def correct(answer: str, expect: str) -> bool:
    """Exact match of the value inside the answer (case-sensitive, as planted)."""
    return expect in answer
