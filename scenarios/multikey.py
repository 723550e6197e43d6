"""Several facts planted at different turns (RULER's multi-key needle, as a chat): three facts of three
value shapes (a four-digit code, a person's name, a multi-token identifier) at the start, the middle and
the last third of the history, with filler turns between them; the last turn asks for one of them.

Session `i` asks for fact `i % 3` (the first, middle or last planted), so every position and, over
sessions, every shape is asked; the two facts not asked are distractors of the same form.
"""

from __future__ import annotations

import random
import string

from . import recall
from .base import Message, Scenario, ScenarioConfig, Session, Turn, fill, rng_for


def identifier(r: random.Random) -> str:
    """A ticket id such as `QX-7431-B`: several tokens, none of them a common word."""
    return f"{''.join(r.choices(string.ascii_uppercase, k=2))}-{r.randint(1000, 9999)}-{r.choice(string.ascii_uppercase)}"


def facts(r: random.Random) -> list[tuple[str, str, str]]:
    """Three (statement, question, value) facts, one of each shape, in a session's order."""
    code = str(r.randint(*recall.CODES))
    name = f"{r.choice(recall.FIRST)} {r.choice(recall.LAST)}"
    ticket = identifier(r)
    out = [
        (f"the vault code is {code}", "What is the vault code? Answer with the number only.", code),
        (f"my manager is {name}", "What is the name of my manager? Answer with the name only.", name),
        (f"the ticket id is {ticket}", "What is the ticket id? Answer with the id only.", ticket),
    ]
    r.shuffle(out)
    return out


def build(cfg: ScenarioConfig) -> Scenario:
    sessions = []
    n_filler = max(2, cfg.turns - 4)
    # the three facts go before filler turn 0, in the middle, and two thirds in
    slots = [0, n_filler // 2, max(n_filler // 2 + 1, (2 * n_filler) // 3)]
    for i in range(cfg.sessions):
        r = rng_for(cfg.seed, "multikey", i)
        planted = facts(r)
        turns = []
        for t in range(n_filler):
            for k, at in enumerate(slots):
                if at == t:
                    turns.append(recall.plant(planted[k][0], cfg))
            topic = r.choice(recall.TOPICS)
            text = fill(r, cfg.filler_tokens, lambda r, t=topic: r.choice(recall.SENTENCES).format(t=t))
            note = f"Here is a note:\n{text}\nWhat is the topic of this note? Answer in a few words."
            turns.append(Turn(inputs=[Message(role="user", content=note)]))
        _, question, value = planted[i % 3]
        turns.append(Turn(inputs=[Message(role="user", content=question)], expect=value, max_new_tokens=16))
        sessions.append(Session(id=f"multikey-{i}", kind="multikey", turns=turns))
    return Scenario(name="multikey", seed=cfg.seed, sessions=sessions)
