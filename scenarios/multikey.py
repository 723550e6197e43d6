"""Several facts planted at different turns (RULER's multi-key needle, as a chat): three facts of three
value shapes (a four-digit code, a person's name, a multi-token identifier) at the start, the middle and
the last third of the history, with filler turns between them; the last turn asks for one of them.

Session `i` asks for the fact at position `i % 3` (the first, middle or last planted), of shape
`(i + i // 3) % 3` (code, name, identifier): nine sessions ask every shape at every position, twelve ask
each shape four times; the two facts not asked, in random order, are distractors of the same form.

Calibrated so that SmolLM2-135M-Instruct answers with a full cache: at the recall suite's sizes (12
sessions, 12 turns, 150-token filler) it answered 4 of 12 before (1 of 5 codes missed, every name and
identifier), 11 of 12 after (results/recall-suite/calibration-multikey: every code and name, 3 of 4
identifiers; the miss drops the id's first letters, "1877-W" for UI-1877-W). What made the difference:

- the assistant's reply to a plant is written by the client ("Your manager is Marta Quill."): the
  model's own echo of a name or of a first-turn plant was mostly wrong ("Lucas Vance is a job title,
  not a person", "This is a special kind of ticket"; "The ticket id is 4648-F." for XV-4648-F), and the
  answer copies the echo;
- the question says to leave the notes ("Forget the notes. Who is my manager?"): asked "What is the
  name of my manager? Answer with the name only." the model answered the filler turns' question ("The
  topic of this note is ...") for every name, with the echo fixed as well;
- the facts are the user's own ("my vault code"), worded as the question asks them.

Filler of logs, word lists, code and JSON (`chatloop.filler`) instead of topical notes answered 6 of 12
with the same plants and question (identifiers answered with the JSON's ids, names with a remark on
the filler or apologies), so the notes stay.
"""

from __future__ import annotations

import random
import string

from . import recall
from .base import Message, Scenario, ScenarioConfig, Session, Turn, fill, rng_for


def identifier(r: random.Random) -> str:
    """A ticket id such as `QX-7431-B`: several tokens, none of them a common word."""
    return f"{''.join(r.choices(string.ascii_uppercase, k=2))}-{r.randint(1000, 9999)}-{r.choice(string.ascii_uppercase)}"


def facts(r: random.Random) -> list[tuple[str, str, str, str]]:
    """Three (statement, the assistant's reply, question, value) facts: a code, a name, an identifier."""
    code = str(r.randint(*recall.CODES))
    name = f"{r.choice(recall.FIRST)} {r.choice(recall.LAST)}"
    ticket = identifier(r)
    return [
        (f"my vault code is {code}", f"Your vault code is {code}.", "What is my vault code?", code),
        (f"my manager is {name}", f"Your manager is {name}.", "Who is my manager?", name),
        (f"my ticket id is {ticket}", f"Your ticket id is {ticket}.", "What is my ticket id?", ticket),
    ]


def build(cfg: ScenarioConfig) -> Scenario:
    sessions = []
    n_filler = max(2, cfg.turns - 4)
    # the three facts go before filler turn 0, in the middle, and three quarters in
    slots = [0, n_filler // 2, max(n_filler // 2 + 1, (3 * n_filler) // 4)]
    for i in range(cfg.sessions):
        r = rng_for(cfg.seed, "multikey", i)
        planted = facts(r)
        asked = planted.pop((i + i // 3) % 3)
        r.shuffle(planted)
        planted.insert(i % 3, asked)
        turns = []
        for t in range(n_filler):
            for k, at in enumerate(slots):
                if at == t:
                    statement, reply, _, _ = planted[k]
                    turns.append(
                        Turn(
                            inputs=[Message(role="user", content=f"Remember this: {statement}.")], reply=reply
                        )
                    )
            topic = r.choice(recall.TOPICS)
            text = fill(r, cfg.filler_tokens, lambda r, t=topic: r.choice(recall.SENTENCES).format(t=t))
            note = f"Here is a note:\n{text}\nWhat is the topic of this note? Answer in a few words."
            turns.append(Turn(inputs=[Message(role="user", content=note)]))
        _, _, question, value = asked
        turns.append(
            Turn(
                inputs=[Message(role="user", content=f"Forget the notes. {question}")],
                expect=value,
                max_new_tokens=16,
            )
        )
        sessions.append(Session(id=f"multikey-{i}", kind="multikey", turns=turns))
    return Scenario(name="multikey", seed=cfg.seed, sessions=sessions)
