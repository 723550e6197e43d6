"""Where a planted fact is at the question: the recall scenario sent turn by turn as raw ids to a live
server with debug positions on, one server per host-tier setting, and per session the planted value's
(layer, head, position) entries on the device over the question turn's kept-timeline events, the answer
and the entries recalled.

    HF_HUB_OFFLINE=1 python benchmarks/recall_probe.py --sessions 8 --variants off,1:0,8:0,8:1,none

`--parts` adds, per question-turn event, what the device holds by part of the chat (entries per layer
and KV head): the system prompt, the plant and the model's echo of it, the older filler notes and their
answers, the last note and its answer, the question, the answer so far.

A variant is `off` (recall_tokens 0), `none` (the full cache, on its own server so no compressed run
reuses its stored prefixes) or `PAGE:EVERY[:SUMMARY]` (`--kv-recall-config '{"page": PAGE, "every": EVERY,
"summary": SUMMARY}'`, the summary `minmax` when left out; R = `--recall`). The chat format is the raw ChatML of tests/test_recall_e2e.py (system prompt, user turns),
not the replay client's, so the full cache answers fewer sessions here than in `benchmarks/replay.py`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sgl_kvevict.scenarios import recall as rs  # noqa: E402
from sgl_kvevict.scenarios.base import ScenarioConfig, Session, Turn  # noqa: E402
from sgl_kvevict.serve.serverproc import Server  # noqa: E402
from tests.helpers import CHECKED_ENV, chat_ids, tokenizer  # noqa: E402

SYSTEM = [{"role": "system", "content": "You are a helpful assistant."}]


def user(text: str) -> list[int]:
    return tokenizer().encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def fact_positions(sess: Session) -> set[int]:
    first = chat_ids(SYSTEM) + user(sess.turns[0].inputs[0].content)
    code = tokenizer().encode(" " + sess.turns[-1].expect, add_special_tokens=False)
    start = next(i for i in range(len(first)) if first[i : i + len(code)] == code)
    return set(range(start, start + len(code)))


def walk(
    sess: Session, answer: Callable[[list[int], Turn], list[int]], question: bool = True
) -> tuple[list[int], list[str], int]:
    """The session sent turn by turn in raw ChatML, each turn answered by `answer(ids, turn)` (its output
    ids): `(ids, parts, start)`, with the part of the chat each position belongs to (`part`) and where the
    last turn starts. `question` False stops before the last turn is answered."""
    ids = chat_ids(SYSTEM)
    parts = ["system"] * len(ids)
    n = len(sess.turns)
    start = len(ids)
    for t, turn in enumerate(sess.turns):
        start = len(ids)
        ids = ids + user(turn.inputs[0].content)
        parts += [part(t, n, answer=False)] * (len(ids) - len(parts))
        if t == n - 1 and not question:
            break
        ids = ids + answer(ids, turn)
        parts += [part(t, n, answer=True)] * (len(ids) - len(parts))
    return ids, parts, start


def run_session(srv: Server, kv: dict, sess: Session) -> tuple[list[dict], list[str]]:
    """The turns' stats, and the part of the chat each position belongs to (`part`)."""
    infos = []

    def answer(ids: list[int], turn: Turn) -> list[int]:
        out = srv.generate(input_ids=ids, max_new_tokens=turn.answer_cap(8), kv=kv)
        infos.append({**(out["meta_info"].get("kvevict") or [{}])[0], "output_ids": out["output_ids"]})
        return out["output_ids"]

    _, parts, _ = walk(sess, answer)
    return infos, parts


def hf_session(model: Any, sess: Session, answer_tokens: int = 8) -> tuple[list[int], list[str], int]:
    """The session as the Hugging Face `model` itself would hold it at the question (offline probes):
    `(ids, parts, start)`, every turn with the model's own greedy answer, ending with the question, which
    starts at `start`."""
    import torch

    def answer(ids: list[int], turn: Turn) -> list[int]:
        cap = turn.answer_cap(answer_tokens)
        return model.generate(torch.tensor([ids]), max_new_tokens=cap, do_sample=False)[
            0, len(ids) :
        ].tolist()

    return walk(sess, answer, question=False)


def part(t: int, n: int, answer: bool) -> str:
    """Turn t of n: the plant (0), the filler notes (the last one apart), the question (n - 1)."""
    name = "plant" if t == 0 else "question" if t == n - 1 else "last note" if t == n - 2 else "notes"
    return f"{name} answer" if answer else name


def composition(info: dict, parts: list[str]) -> list[dict[str, float]]:
    """Per kept-timeline event: entries held per (layer, KV head), by part of the chat."""
    out = []
    for ev in info.get("kept_timeline") or []:
        rows = [row for layer in ev["positions"] for row in layer]
        counts: dict[str, float] = {}
        for row in rows:
            for p in row:
                name = parts[p] if p < len(parts) else "question answer"
                counts[name] = counts.get(name, 0) + 1 / len(rows)
        out.append(counts)
    return out


def held(info: dict, fact: set[int]) -> list[int]:
    return [
        sum(len(fact.intersection(row)) for layer in ev["positions"] for row in layer)
        for ev in info.get("kept_timeline") or []
    ]


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server on the way out
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--recall", type=int, default=64, help="R, per layer and KV head")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--variants", default="off,1:0,8:0,8:1,none")
    ap.add_argument(
        "--min-score", type=float, default=None, help="--kv-recall-config min_score (default: the server's)"
    )
    ap.add_argument(
        "--append",
        choices=("on", "off"),
        default=None,
        help="--kv-recall-config append (default: the server's)",
    )
    ap.add_argument("--parts", action="store_true", help="what the device holds, by part of the chat")
    a = ap.parse_args()
    scenario = rs.build(ScenarioConfig(sessions=a.sessions, turns=a.turns, seed=0, filler_tokens=150))
    for var in a.variants.split(","):
        tuning: dict = {}
        if var not in ("off", "none"):
            page, every, *summary = var.split(":")
            tuning = {"page": int(page), "every": int(every)}
            tuning.update({"summary": summary[0]} if summary else {})
        args = ["--max-total-tokens", "30000", "--kv-policy", a.policy, "--kv-budget", str(a.budget)]
        args += ["--kv-policy-config", '{"scope": "branch"}', "--kv-recall-tokens", str(a.recall)]
        args += ["--kv-host-tokens", "200000"]
        if a.min_score is not None:
            tuning["min_score"] = a.min_score
        if a.append is not None:
            tuning["append"] = a.append
        if tuning:
            args += ["--kv-recall-config", json.dumps(tuning)]
        if var == "none":
            kv = {"policy": "none"}
        else:
            kv = {"policy": a.policy, "budget": a.budget, "config": {"scope": "branch"}}
            kv["recall_tokens"] = 0 if var == "off" else a.recall
        with Server(args, env=CHECKED_ENV, timeout=1200) as srv:
            ok, ends, moved = 0, [], []
            for sess in scenario.sessions:
                infos, parts = run_session(srv, kv, sess)
                q = infos[-1]
                answer = tokenizer().decode(q["output_ids"])
                good = rs.correct(answer, sess.turns[-1].expect)
                ok += good
                h = held(q, fact_positions(sess)) if var != "none" else []
                ends.append(h[-1] if h else None)
                moved.append(sum(i.get("recalled", 0) for i in infos))
                print(
                    f"  {var} {sess.id}: correct={good} held={h} answer={answer.strip()[:30]!r}", flush=True
                )
                if a.parts and var != "none":
                    for i, counts in enumerate(composition(q, parts)):
                        cells = ", ".join(f"{k} {v:.1f}" for k, v in counts.items())
                        print(f"    event {i}: {sum(counts.values()):.0f} held: {cells}", flush=True)
            print(
                f"== {var}: {ok}/{len(scenario.sessions)} answered; held at the end {ends}; recalled/session {moved}"
            )


if __name__ == "__main__":
    main()
