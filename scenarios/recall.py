"""Recall chat: a fact (a code, a name or a number) is planted in the first turn, filler turns follow,
and the last turn asks for it; the answer must contain the exact value.

Calibrated so that SmolLM2-135M-Instruct gets it right with a full cache (19-20/20 offline, see
docs/benchmarks.md "Recall calibration"): only then does a miss under compression measure what
compression costs. What made the difference, measured on 20 chats:

- the plant is one short statement with nothing to do ("Remember this: the vault code is 4817."):
  asking for a confirmation or an echo made the model answer with a canned refusal or garble it;
- the filler turns ask for the note's topic in a few words, not a summary: a summary copies a filler
  sentence, and the model then repeats that sentence instead of answering the question;
- the question names the fact as planted and asks for the bare value;
- the plant's answer has room to finish (`plant_room`, 16 tokens, whatever `--max-new-tokens`; the
  echo of a four-digit code, its full stop and the end of the turn take 11): the model
  often echoes the fact ("The vault code is 4161."), and an echo cut at 8 tokens ("The vault code is
  416") is a wrong copy of the fact in the same words the answer uses. The full cache still answers
  from the user's statement; a compressed history that kept or recalled the echo answered "416".

The fact stays in the first turn, with every filler turn after it, so it is the oldest part of the
history that a compression policy sees. Beyond two filler turns (`turns` > 4) SmolLM2-135M misses more with a
full cache: at 14 turns it answers 24 of 36, every code and budget and no name (asked for a name it
answers the filler turns' question instead, `gave_filler_answer`); compare a compressed run with `none`
from the same replay, kind by kind (`kind`). The `recall-code` scenario (`build_code`) is the same chat
with a four-digit vault code as every session's fact, the kind the full cache answers at 14 turns, so
that a miss under compression there is compression's. With `question_forks` the
question is a fork: several branches off the same history ask for the fact at once, each in its own
words, and each must answer it.
"""

from __future__ import annotations

import random
import re

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


# With `question_forks`, branch i asks the question after ASK[i] (the first asks it as it is).
ASK = ["", "Quick question. ", "One more thing. ", "Please help me. "]


# The values a fact draws: a four-digit code, or a trip budget in dollars (`kind` tells them apart).
CODES = (1000, 9999)
BUDGETS = (20, 990)
# The filler turns' answer ("The topic of this note is ..."): a miss that gives it answers their question.
FILLER_ANSWER = "topic of this note"


def fact(r: random.Random, kinds: tuple[str, ...] = ("code", "name", "number")) -> tuple[str, str, str]:
    """(statement, question, expected value)."""
    kind = r.choice(list(kinds))
    if kind == "code":
        v = str(r.randint(*CODES))
        return f"the vault code is {v}", "What is the vault code? Answer with the number only.", v
    if kind == "name":
        v = f"{r.choice(FIRST)} {r.choice(LAST)}"
        return f"my manager is {v}", "What is the name of my manager? Answer with the name only.", v
    v = str(r.randint(*BUDGETS))
    return (
        f"the trip budget is {v} dollars",
        "What is the trip budget? Answer with the number only.",
        v,
    )


def _user(content: str) -> list[Message]:
    return [Message(role="user", content=content)]


def plant(statement: str, cfg: ScenarioConfig) -> Turn:
    """The turn that plants the fact, with room for the model's echo of it (`plant_room`)."""
    return Turn(inputs=_user(f"Remember this: {statement}."), min_new_tokens=cfg.plant_room or None)


def code_fact(r: random.Random) -> tuple[str, str, str]:
    """The `recall-code` scenario's fact: `fact`'s four-digit vault code, the kind SmolLM2-135M recalls
    after 12 filler turns with a full cache (it misses names there, see the module docstring). Worded as
    `fact` words it: asked to remember "my locker code", the model answers the plant with "This is a
    classic example of a password-related error" and later cannot give the code (0 of 12, full cache)."""
    return fact(r, ("code",))


def build(cfg: ScenarioConfig) -> Scenario:
    return _build(cfg, "recall", fact)


def build_code(cfg: ScenarioConfig) -> Scenario:
    """`recall-code`: the recall chat with a vault code as every session's fact, so that the full cache
    answers (nearly) every question at 14 turns and each miss under compression is compression's."""
    return _build(cfg, "recall-code", code_fact)


def _build(cfg: ScenarioConfig, name: str, make_fact) -> Scenario:
    sessions = []
    for i in range(cfg.sessions):
        r = rng_for(cfg.seed, name, i)
        statement, question, value = make_fact(r)
        turns = [plant(statement, cfg)]
        for _ in range(max(0, cfg.turns - 2)):
            topic = r.choice(TOPICS)
            text = fill(r, cfg.filler_tokens, lambda r, t=topic: r.choice(SENTENCES).format(t=t))
            note = f"Here is a note:\n{text}\nWhat is the topic of this note? Answer in a few words."
            turns.append(Turn(inputs=_user(note)))
        if cfg.question_forks > 1:  # one stored history, several branches asking at once (a fork)
            asks = [[Message(role="user", content=f"{p}{question}")] for p in ASK[: cfg.question_forks]]
            turns.append(Turn(inputs=[], branches=asks, expect=value, max_new_tokens=16))
        else:
            turns.append(Turn(inputs=_user(question), expect=value, max_new_tokens=16))
        sessions.append(Session(id=f"{name}-{i}", kind=name, turns=turns))
    return Scenario(name=name, seed=cfg.seed, sessions=sessions)


def correct(answer: str, expect: str) -> bool:
    """The exact value somewhere in the answer, formatting aside.

    A number must appear as a whole number ("The code is 4817." is right, "48170" is not; a thousands
    separator is ignored); a name must appear as whole words, case and spacing aside.
    """
    if expect.isdigit():
        return expect in re.findall(r"\d+", re.sub(r"(?<=\d),(?=\d{3}\b)", "", answer))
    words = r"\s+".join(re.escape(w) for w in expect.split())
    return re.search(rf"(?<!\w){words}(?!\w)", answer, flags=re.IGNORECASE) is not None


def kind(expect: str) -> str:
    """Which fact a question asks for (`fact`'s kinds), from its expected value alone: the replay records
    only the value."""
    if not expect.isdigit():
        return "name"
    return "code" if CODES[0] <= int(expect) <= CODES[1] else "number"


def gave_filler_answer(answer: str) -> bool:
    """The answer is the filler turns' one: the model answered their question, not this one."""
    return FILLER_ANSWER in answer.lower()
