"""The recall suite: task families that no recall design was tuned on, one table.

    HF_HUB_OFFLINE=1 python benchmarks/recall_suite.py --locomo-path <LoCoMo locomo10.json or folder> \\
        --policies snapkv,d2o,h2o,knorm,lagkv --fractions 0.12,0.18,0.25 --out results/recall-suite

One server (started here, or `--url`) with the host tier on (`--kv-recall-tokens`, branch scope); per
family, the full cache (`none`) runs first, then each policy at each fraction of the family's context on
the device, with recall at the server's defaults and without it (`recall_tokens: 0` per request). A
fraction becomes a token budget per family: `fraction x` the family's median context at the question,
less what the device holds besides the budget while answering (the recalled entries, the sinks and the
recent window), so that the cell's device KV is about that fraction; the table prints the measured one.

Families (sizes in `FAMILIES`; the aim is a full cache that answers at least 10 of 12, and
docs/benchmarks.md says which families reach it):

- `recall-code`: the recall scenario as it is (the model's own answers, topical notes, a code in turn 1);
- `composed`, `composed-chat`: client-composed histories (the client writes the history; each turn
  generates one token, which it drops), through `/generate` with token ids and through the OpenAI chat API;
- `chatloop`: the model's own replies re-sent, filler of logs, word lists, code and JSON tool output, the
  fact in the middle or the last third;
- `multikey`: three facts of three shapes (digits, a name, an identifier) at the start, middle and last
  third, one asked;
- `forks`: `recall-code` with the question asked by two branches at once off one stored history;
- `locomo`: LoCoMo conversations 6-10 (1-5 are held out), three consecutive stretches of each (about
  2,000 tokens of dialog, a session each), the dataset's questions on each stretch as branches, token F1.

Cells: answered / sessions (F1 x 100 for `locomo`) beside the full cache's, then the device KV while
answering as a percent of the context. An F1 cell also gives the F1 as a percent of the full cache's
over the same questions, with its paired bootstrap 95% interval (`f1_share`). The memory-pressure
replay is `benchmarks/replay.py`'s own command (docs/benchmarks.md). Writes `suite.json` and
`suite.md` under `--out`, and one replay folder per run under its family's (`composed/none`, `composed/snapkv-18pct`, ...); `--resume` reads back the
finished ones instead of running them again, so a cut-off suite continues where it stopped;
`--report` only reads them back and prints the table (no server; a blank cell where a run is missing).
A compressed answer can change with how the server scheduled the sessions (docs/benchmarks.md,
`multikey`), so a design is judged over several schedules: `--report --pool DIR` pools each cell with
the same run under DIR (say, the suite with `--concurrency 1`; the same policy and fraction, whose budget
follows that schedule's own context): answers summed, F1 over every question.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replay  # noqa: E402

from sgl_kvevict.scenarios.base import ScenarioConfig  # noqa: E402

# family -> (scenario, its sizes); each family's full-cache count is in docs/benchmarks.md (recall suite).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "recall-code": ("recall-code", {"turns": 10, "filler_tokens": 150}),
    "composed": ("composed", {"turns": 14, "filler_tokens": 120}),
    "composed-chat": ("composed-chat", {"turns": 14, "filler_tokens": 120}),
    "chatloop": ("chatloop", {"turns": 12, "filler_tokens": 150}),
    "multikey": ("multikey", {"turns": 12, "filler_tokens": 150}),
    "forks": ("recall-code", {"turns": 10, "filler_tokens": 150, "question_forks": 2}),
    "locomo": ("locomo", {"turns": 10, "filler_tokens": 200, "windows": 3}),
}
SINKS_AND_WINDOW = 36  # what every policy keeps besides its budget (4 sinks + a 32-token recent window)
MIN_BUDGET = 16


def question_turns(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in run["turns"] if t["expect"] is not None and not t["error"]]


def score(run: dict[str, Any]) -> tuple[float, int]:
    """(answered, asked), or (mean F1, asked) for a family scored by F1."""
    qs = question_turns(run)
    if qs and qs[0]["f1"] is not None:
        return (statistics.fmean(t["f1"] for t in qs), len(qs))
    return (float(sum(bool(t["correct"]) for t in qs)), len(qs))


def device_share(run: dict[str, Any]) -> float | None:
    """Median over questions of the KV slots the answer read over, as a share of its context."""
    xs = [
        (t["peak_kv_tokens"] or t["kv_tokens"]) / t["prompt_tokens"]
        for t in question_turns(run)
        if (t["peak_kv_tokens"] or t["kv_tokens"]) and t["prompt_tokens"]
    ]
    return statistics.median(xs) if xs else None


def f1_share(
    full: dict[str, Any], run: dict[str, Any], draws: int = 2000
) -> tuple[float, float, float] | None:
    """`run`'s F1 as a share of the full cache's over the same questions, with a paired bootstrap 95%
    interval (questions drawn with replacement, both runs' answers to each drawn question together): at
    a few dozen questions, most answering F1 0 either way, the interval says how far apart two cells
    must be to differ. None where the full cache scores F1 0 on every shared question."""
    ref = {(t["session"], t["turn"], t["branch"]): t["f1"] for t in question_turns(full)}
    got = {(t["session"], t["turn"], t["branch"]): t["f1"] for t in question_turns(run)}
    keys = sorted(k for k in ref if k in got)
    if not keys or not sum(ref[k] for k in keys):
        return None
    rng = random.Random(0)  # the same draws for every cell: the table is reproducible
    shares = []
    for _ in range(draws):
        pick = [rng.choice(keys) for _ in keys]
        base = sum(ref[k] for k in pick)
        if base:  # a draw of only the full cache's F1-0 questions has no share
            shares.append(sum(got[k] for k in pick) / base)
    shares.sort()
    share = sum(got[k] for k in keys) / sum(ref[k] for k in keys)
    return share, shares[int(0.025 * len(shares))], shares[int(0.975 * len(shares)) - 1]


def budget_for(fraction: float, context: int, recall_tokens: int) -> int:
    return max(MIN_BUDGET, round(fraction * context) - recall_tokens - SINKS_AND_WINDOW)


def cell(value: tuple[float, int], f1: bool) -> str:
    return f"{100 * value[0]:.1f}" if f1 else f"{value[0]:.0f}/{value[1]}"


def table(rows: dict[str, dict[str, Any]], families: list[str], f1_families: set[str]) -> str:
    head = "| run | " + " | ".join(families) + " |\n|---|" + "---|" * len(families) + "\n"
    lines = []
    for name, by_family in rows.items():
        cells = []
        for fam in families:
            r = by_family.get(fam)
            if r is None:
                cells.append("")
                continue
            text = cell(r["score"], fam in f1_families)
            if name != "none":
                text += f" ({cell(r['full'], fam in f1_families)})"
                if r.get("share") is not None:
                    share, lo, hi = (round(100 * x) for x in r["share"])
                    text += f" {share}% [{lo}-{hi}]"
            if r["device"] is not None:
                text += f", {100 * r['device']:.0f}%"
            cells.append(text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def row_order(rows: dict[str, dict[str, Any]], a: argparse.Namespace, fractions: list[float]) -> dict:
    """`rows` as the table lists them: the full cache, then by fraction, policy, with recall then without."""
    names = [
        f"{pol} {frac:.0%}{suffix}"
        for frac in fractions
        for pol in a.policies.split(",")
        for suffix in ("", " no recall")
    ]
    return {k: rows[k] for k in ["none", *names] if k in rows}


def write_table(
    out: Path, rows: dict[str, dict[str, Any]], families: list[str], f1_families: set[str]
) -> None:
    """`suite.md` and `suite.json` under `out`, rewritten as each family ends."""
    (out / "suite.md").write_text(table(rows, families, f1_families))
    (out / "suite.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


def norecall_spec(policy: str) -> str:
    """The spec of `policy`'s run without recall: a variant of its own (`d2o#nomerge` -> `d2o#nomerge-norecall`)."""
    return f"{policy}-norecall" if "#" in policy else f"{policy}#norecall"


def policy_configs(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """`--policy-config` by policy or variant, and each policy's run without recall: its own config plus
    `recall_tokens: 0` per request."""
    given: dict[str, dict[str, Any]] = json.loads(a.policy_config)
    out = dict(given)
    for pol in a.policies.split(","):
        out[norecall_spec(pol)] = {**given.get(pol, {}), "recall_tokens": 0}
    return out


def replay_cfg(a: argparse.Namespace, family: str, url: str, out: Path, policies: list[str]) -> Any:
    scenario, sizes = FAMILIES[family]
    return replay.BenchConfig(
        scenarios=[scenario],
        scenario=ScenarioConfig(
            sessions=a.sessions, seed=a.seed, path=a.locomo_path, conversations="6-10", **sizes
        ),
        concurrency=a.concurrency,
        max_new_tokens=a.max_new_tokens,
        policies=policies,
        policy_configs=policy_configs(a),
        budgets=[0.5],  # unused: every spec names its budget
        server_mode="url",
        url=url,
        baseline=policies == ["none"],
        score="none",
        stream=False,
        max_total_tokens=a.max_total_tokens,
        out=out,
    )


def run_folder(name: str) -> str:
    """A run's folder under its family's: `snapkv 18% no recall` -> `snapkv-18pct-no-recall`."""
    return name.replace("%", "pct").replace(" ", "-").replace("#", "-")


def finished(a: argparse.Namespace, out: Path, spec: str, any_budget: bool = False) -> dict[str, Any] | None:
    """The finished replay of `spec` in `out` (same spec and sessions, not partial), or None. With
    `any_budget`, the same policy and scope at any budget: another schedule of a family whose history
    holds the model's own replies has another context, so the same fraction is another budget."""
    done = out / "replay.json"
    if not done.exists():
        return None
    old = json.loads(done.read_text())
    cfg = old["config"]
    ran = [p.split("=")[0] if any_budget else p for p in cfg["policies"]]  # `policy@scope=budget`
    want = spec.split("=")[0] if any_budget else spec
    if old.get("partial") or ran != [want] or cfg["scenario"]["sessions"] != a.sessions:
        return None
    return old["runs"][0]


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run of the questions of all `runs` (the same spec under several schedules): each run's
    sessions keep their own names (`0:`, `1:`, ... before them), so the F1 share pairs each question
    with the full cache's under the same schedule."""
    turns = [{**t, "session": f"{i}:{t.get('session')}"} for i, r in enumerate(runs) for t in r["turns"]]
    return {**runs[0], "turns": turns}


def run_one(
    a: argparse.Namespace, family: str, url: str | None, out: Path, spec: str, what: str
) -> dict[str, Any] | None:
    """One replay of `spec` on `family` into `out`; with `--resume`, a finished one already there is read
    back instead; with `--report`, only read back (None where there is none), pooled with the same run
    under each `--pool` folder (None where one of them lacks it)."""
    old = finished(a, out, spec) if a.resume or a.report else None
    if a.report and a.pool and old is not None:
        where = out.relative_to(Path(a.out))
        others = [finished(a, Path(d) / where, spec, any_budget=True) for d in a.pool]
        if any(o is None for o in others):
            print(f"[suite] {family}: {what}: not in every --pool folder, left out", file=sys.stderr)
            return None
        old = pooled([old, *others])
    if old is not None or a.report:
        print(
            f"[suite] {family}: {what}: {'reusing' if old else 'no finished run in'} {out}", file=sys.stderr
        )
        return old
    print(f"[suite] {family}: {what}", file=sys.stderr)
    return replay.main(replay_cfg(a, family, url, out, [spec]))["runs"][0]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--families", default=",".join(FAMILIES), help="comma list of: " + ", ".join(FAMILIES))
    p.add_argument("--policies", default="snapkv,d2o,h2o,knorm,lagkv")
    p.add_argument("--fractions", default="0.12,0.18,0.25", help="device KV as a share of the context")
    p.add_argument(
        "--no-recall-runs",
        dest="norecall",
        action="store_false",
        help="skip each policy's run without recall",
    )
    p.add_argument(
        "--policy-config",
        default="{}",
        help='JSON: config per policy or variant, e.g. \'{"d2o#nomerge": {"merge": false}}\' with '
        "--policies d2o,d2o#nomerge",
    )
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--recall-tokens", type=int, default=64, help="the server's --kv-recall-tokens")
    p.add_argument("--max-total-tokens", type=int, default=60000)
    p.add_argument("--locomo-path", help="LoCoMo's data/locomo10.json (or its folder of ten files)")
    p.add_argument("--url", help="a running server with the host tier on (else one is started here)")
    p.add_argument("--server-arg", action="append", default=[], help="extra server flag (FLAG=VALUE)")
    p.add_argument("--out", default="results/recall-suite")
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse each finished run already under --out (same family and spec) instead of running it",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="run nothing (no server): print the table of the runs already finished under --out, a cell "
        "left blank where its run is missing",
    )
    p.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="DIR",
        help="with --report: pool each cell with the same run under DIR (another schedule or seed of the "
        "same suite; repeatable): answers summed, F1 over every question",
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser()
    a = p.parse_args(argv)
    families = a.families.split(",")
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        p.error(f"unknown family {bad[0]!r}; valid: {', '.join(FAMILIES)}")
    if "locomo" in families and not a.locomo_path and not a.report:
        p.error("family locomo needs --locomo-path (LoCoMo's data/locomo10.json)")
    if a.pool and not a.report:
        p.error("--pool pools finished runs: give it with --report")
    fractions = [float(x) for x in a.fractions.split(",")]
    if any(not 0 < f < 1 for f in fractions):
        p.error("--fractions are shares of the context in (0, 1)")
    for pol in a.policies.split(","):
        replay.parse_spec(pol)  # exits naming the valid policies
    try:
        given = json.loads(a.policy_config)
    except json.JSONDecodeError as e:
        p.error(f"--policy-config is not JSON: {e}")
    if not isinstance(given, dict) or not all(isinstance(v, dict) for v in given.values()):
        p.error(
            '--policy-config maps a policy or variant to its config, e.g. {"d2o#nomerge": {"merge": false}}'
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {"none": {}}
    f1_families = {f for f in families if FAMILIES[f][0] == "locomo"}
    with ExitStack() as stack:
        url = a.url
        if url is None and not a.report:
            from sgl_kvevict.serve.serverproc import Server

            args = [
                "--kv-policy",
                "lagkv",
                "--kv-recall-tokens",
                str(a.recall_tokens),
                "--max-total-tokens",
                str(a.max_total_tokens),
            ]
            args += [x for arg in a.server_arg for x in arg.split("=", 1)]
            url = stack.enter_context(Server(args, log_path=out / "server.log", timeout=900)).url
        for fam in families:
            full = run_one(a, fam, url, out / fam / "none", "none", "full cache")
            if full is None:  # --report without the full cache's run: the family's budgets are unknown
                continue
            context = round(statistics.median(t["prompt_tokens"] for t in question_turns(full)))
            base = score(full)
            rows["none"][fam] = {"score": base, "full": base, "device": 1.0, "context": context}
            specs = []
            for frac in fractions:
                b = budget_for(frac, context, a.recall_tokens)
                for pol in a.policies.split(","):
                    specs.append((f"{pol} {frac:.0%}", f"{pol}@branch={b}"))
                    if a.norecall:
                        specs.append((f"{pol} {frac:.0%} no recall", f"{norecall_spec(pol)}@branch={b}"))
            print(f"[suite] {fam}: context {context}, {len(specs)} runs", file=sys.stderr)
            for i, (name, spec) in enumerate(specs, 1):
                run = run_one(a, fam, url, out / fam / run_folder(name), spec, f"{i}/{len(specs)} {name}")
                if run is None:
                    continue
                rows.setdefault(name, {})[fam] = {
                    "score": score(run),
                    "full": base,
                    "device": device_share(run),
                    "budget": run["budget"],
                    "share": f1_share(full, run) if fam in f1_families else None,
                }
            rows = row_order(rows, a, fractions)
            if not a.pool:  # a pooled table is printed only: `--out`'s own table stays its own
                write_table(out, rows, families, f1_families)
    print(table(rows, families, f1_families))
    return rows


if __name__ == "__main__":
    main()
