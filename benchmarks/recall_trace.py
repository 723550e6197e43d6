"""Where a question's answer is on the device while it is answered: a replay of `multikey` sessions, one
at a time, against a server started with `KVEVICT_DEBUG=1` (its requests report the logical positions
each layer and KV head holds after every compression, recall and decode step: `kept_timeline`).

    KVEVICT_DEBUG=1 python -m sgl_kvevict.launch --kv-policy lagkv --kv-recall-tokens 64 --port 30000 &
    HF_HUB_OFFLINE=1 python benchmarks/recall_trace.py --url http://127.0.0.1:30000 --policy h2o \\
        --budget 84 --sessions 0,1

For the question turn of each session, per timeline event: the tokens it stands for, and how many of the
asked value's (layer, KV head, position) entries the device holds, over every place the value occurs in
the history (the user's statement and the reply); then the positions the turn's append brought back in
at least half of the (layer, KV head) pairs, as text. Sessions run in the order given, one at a time: a
compressed answer can change with what ran before it (docs/benchmarks.md, `multikey`).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replay  # noqa: E402
import replay_client as rc  # noqa: E402


def value_positions(tok: Any, prompt: list[int], value: str) -> list[int]:
    """Every position of `value`'s tokens in `prompt`, where it follows a space (" 1233")."""
    code = list(tok.encode(" " + value, add_special_tokens=False))
    starts = [i for i in range(len(prompt) - len(code) + 1) if prompt[i : i + len(code)] == code]
    return sorted({s + j for s in starts for j in range(len(code))})


def held(event: dict, positions: list[int]) -> int:
    """The (layer, KV head, position) entries of `positions` that `event` holds on the device."""
    want = set(positions)
    return sum(len(want.intersection(row)) for layer in event["positions"] for row in layer)


def appended(before: dict, after: dict) -> Counter:
    """Per position, the (layer, KV head) pairs that hold it after `after` and did not before."""
    n: Counter = Counter()
    for lb, la in zip(before["positions"], after["positions"], strict=True):
        for hb, ha in zip(lb, la, strict=True):
            n.update(set(ha) - set(hb))
    return n


def trace(url: str, policy: str, budget: int, sessions: list[int], turns: int) -> list[dict]:
    from transformers import AutoTokenizer

    from sgl_kvevict.model import default_model_path

    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    cfg = replay.parse(
        ["--scenarios", "multikey", "--sessions", str(max(sessions) + 1), "--turns", str(turns)]
        + ["--filler-tokens", "150", "--url", url, "--server-mode", "url", "--no-stream"]
    )
    built = {s.id: s for s in replay.load_scenarios(cfg)}
    calls: list[tuple[list[int], rc.Call]] = []
    send = rc.generate

    def kept(url: str, ids: list[int], n: int, kv: dict | None, stream: bool = True, **kw: Any) -> rc.Call:
        call = send(url, ids, n, kv, stream, **kw)
        calls.append((ids, call))
        return call

    rc.generate = kept  # the replayer's own requests, kept with their timelines
    kv = {"policy": policy, "budget": budget, "config": {"scope": "branch"}}
    out = []
    try:
        for i in sessions:
            s = built[f"multikey-{i}"]
            calls.clear()
            replay.Replayer(cfg, rc.ChatIds(tok), url, kv, replay.tqdm(disable=True)).session(s)
            prompt, call = calls[-1]
            stats = (call.meta.get("kvevict") or [{}])[-1]
            timeline = stats.get("kept_timeline")
            if not timeline:
                raise SystemExit("recall_trace: no kept_timeline: start the server with KVEVICT_DEBUG=1")
            value = s.turns[-1].expect
            pos = value_positions(tok, prompt, value)
            out.append({"session": s.id, "value": value, "answer": call.text, "positions": pos,
                        "timeline": timeline, "prompt": prompt, "tok": tok})  # fmt: skip
    finally:
        rc.generate = send
    return out


def report(t: dict) -> str:
    tl, pos = t["timeline"], t["positions"]
    pairs = len(tl[0]["positions"]) * len(tl[0]["positions"][0])
    lines = [f"## {t['session']}: asked {t['value']!r}, answered {t['answer']!r}", ""]
    lines += [f"value positions {pos[:1] + pos[-1:]} ({len(pos)}), {pairs} (layer, KV head) pairs", ""]
    lines += ["| event | tokens | rows hold | value entries held |", "|---|---|---|---|"]
    rows = [len(ev["positions"][0][0]) for ev in tl]
    for i, ev in enumerate(tl):
        lines.append(f"| {i} | {ev['tokens']} | {rows[i]} | {held(ev, pos)} of {len(pos) * pairs} |")
    # the turn's append: the first event whose rows grew at the same tokens, short of them all (the prefill
    # over both tiers is an event that sees every position)
    grow = next(
        (i for i in range(1, len(tl)) if rows[i - 1] < rows[i] < tl[i]["tokens"] == tl[i - 1]["tokens"]), None
    )
    if grow is not None:
        n = appended(tl[grow - 1], tl[grow])
        common = sorted(p for p, c in n.items() if 2 * c >= pairs)
        runs: list[list[int]] = []
        for p in common:
            if runs and p == runs[-1][-1] + 1:
                runs[-1].append(p)
            else:
                runs.append([p])
        text = [f"{r[0]}-{r[-1]} {t['tok'].decode(t['prompt'][r[0] : r[-1] + 1])!r}" for r in runs]
        lines += ["", f"appended in at least half of the pairs (event {grow}): " + "; ".join(text)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="a server started with KVEVICT_DEBUG=1 and recall on")
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--budget", type=int, default=84, help="tokens, branch scope (the suite's 12%%: 84)")
    ap.add_argument("--sessions", default="0", help="comma list of multikey session numbers (0-99)")
    ap.add_argument("--turns", type=int, default=12)
    a = ap.parse_args(argv)
    try:
        sessions = [int(x) for x in a.sessions.split(",")]
    except ValueError:
        ap.error("--sessions: a comma list of session numbers")
    if not all(0 <= i < 100 for i in sessions) or not 1 <= a.budget <= 1 << 20 or not 4 <= a.turns <= 64:
        ap.error("--sessions in [0, 100), --budget in [1, 2^20], --turns in [4, 64]")
    replay.parse_spec(a.policy)  # exits naming the valid policies
    for t in trace(a.url, a.policy, a.budget, sessions, a.turns):
        print(report(t), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
