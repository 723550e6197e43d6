"""A chat loop over filler that is not topical prose: logs, word lists, code and JSON tool output, with
the model's own replies sent back as history, and the fact planted in the middle or the last third of
the history instead of the first turn.

Each filler turn shows one block and asks a short question about it; the fact is a plain user
statement at a turn drawn from the middle third or the last third (alternating by session); the last
turn asks for it. What the device keeps after each turn is then chosen among very different kinds of
tokens, and the fact has filler on both sides of it.
"""

from __future__ import annotations

import random

from . import agent, recall
from .base import Message, Scenario, ScenarioConfig, Session, Turn, fill, rng_for
from .composed import words

CODE_LINES = [
    "def {w}_{n}(items):",
    "    total = sum(x.{w} for x in items if x.{w} > {n})",
    "    return {{'{w}': total, 'count': len(items)}}",
    "for i in range({n}):",
    "    cache[{n}] = load_{w}(i)",
    "class {W}Handler:",
    "    timeout = {n}",
]


def _code(r: random.Random) -> str:
    w = r.choice(agent.WORDS)
    return r.choice(CODE_LINES).format(w=w, W=w.capitalize(), n=r.randint(2, 999))


def filler(r: random.Random, tokens: int) -> tuple[str, str]:
    """(block, question) of one filler turn: a log, a word list, code or JSON tool output."""
    kind = r.choice(["log", "words", "code", "json"])
    svc = r.choice(agent.SERVICES)
    if kind == "log":
        body = fill(r, tokens, lambda r: agent.KINDS[0][2](r, svc), chars_per_token=2.0)
        return f"Log excerpt:\n{body}", "Which service wrote this log? One word."
    if kind == "words":
        return f"Word list: {words(r, tokens)}", "Is this a list of words? Answer yes or no."
    if kind == "code":
        body = fill(r, tokens, _code, chars_per_token=3.0)
        return f"Code:\n{body}", "Which programming language is this? One word."
    body = fill(r, tokens, lambda r: agent.KINDS[1][2](r, svc), chars_per_token=2.0)
    return f"Tool output (query_api):\n{body}", "Which service is this JSON about? One word."


def plant_turn(i: int, n_filler: int) -> int:
    """Where session `i` plants its fact among `n_filler + 1` history turns: the middle third for even
    sessions, the last third for odd ones."""
    n = n_filler + 1
    return n // 2 if i % 2 == 0 else min(n - 1, (5 * n) // 6)


def build(cfg: ScenarioConfig) -> Scenario:
    sessions = []
    n_filler = max(1, cfg.turns - 2)
    for i in range(cfg.sessions):
        r = rng_for(cfg.seed, "chatloop", i)
        statement, question, value = recall.code_fact(r)
        at = plant_turn(i, n_filler)
        turns = []
        for t in range(n_filler + 1):
            if t == at:
                turns.append(recall.plant(statement, cfg))
                continue
            block, ask = filler(r, cfg.filler_tokens)
            turns.append(Turn(inputs=[Message(role="user", content=f"{block}\n{ask}")]))
        turns.append(Turn(inputs=[Message(role="user", content=question)], expect=value, max_new_tokens=16))
        sessions.append(Session(id=f"chatloop-{i}", kind="chatloop", turns=turns))
    return Scenario(name="chatloop", seed=cfg.seed, sessions=sessions)
