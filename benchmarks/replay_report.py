"""Aggregation of replay runs (each policy against `none` from the same run), markdown table and plots."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from sgl_kvevict.scenarios import recall


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    i = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[i]


def mean(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _key(t: dict) -> tuple:
    return (t["session"], t["turn"], t["branch"])


def final_kv(turns: list[dict]) -> dict[str, int | None]:
    """KV held by each session when its last turn finished (branch 0)."""
    last: dict[str, dict] = {}
    for t in turns:
        if t["branch"] == 0 and (t["session"] not in last or t["turn"] > last[t["session"]]["turn"]):
            last[t["session"]] = t
    return {s: t["kv_tokens"] for s, t in last.items()}


def kv_by_turn(turns: list[dict], key: str = "kv_tokens") -> list[float | None]:
    """Mean over sessions of `key` (KV held by the session, or its branch's own part) at the end of each
    turn; index i is turn i + 1; None where no session reported it."""
    by: dict[int, list[int]] = {}
    for t in turns:
        if t["branch"] == 0 and not t.get("error"):
            by.setdefault(t["turn"], [])
            if t.get(key) is not None:
                by[t["turn"]].append(t[key])
    n = max(by, default=-1) + 1
    return [statistics.fmean(by[i]) if by.get(i) else None for i in range(n)]


def final_branch_kv(turns: list[dict]) -> dict[str, int | None]:
    """`branch_kv_tokens` of each session's last turn (branch 0)."""
    last: dict[str, dict] = {}
    for t in turns:
        if t["branch"] == 0 and (t["session"] not in last or t["turn"] > last[t["session"]]["turn"]):
            last[t["session"]] = t
    return {s: t.get("branch_kv_tokens") for s, t in last.items()}


def summarize(run: dict, base: dict | None, pool: int) -> dict[str, Any]:
    turns = [t for t in run["turns"] if not t.get("error")]
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)
    kv = final_kv(turns)
    kv_mean = mean(list(kv.values()))
    # answers checked against an expected value; a dataset scored by token F1 (LoCoMo) has `f1` instead
    recall = [t["correct"] for t in turns if t.get("expect") is not None and t.get("correct") is not None]
    f1s = [t["f1"] for t in turns if t.get("f1") is not None]
    out: dict[str, Any] = {
        "label": run["label"],
        "policy": run["policy"],
        "scope": run.get("scope"),
        "budget": run["budget"],
        "requests": len(run["turns"]),
        "errors": sum(1 for t in run["turns"] if t.get("error")),
        "kv_per_session": kv_mean,
        "branch_kv_per_session": mean(list(final_branch_kv(turns).values())),
        "kv_by_turn": kv_by_turn(turns),
        "branch_kv_by_turn": kv_by_turn(turns, "branch_kv_tokens"),
        "capacity_sessions": pool / kv_mean if kv_mean else None,
        "peak_running_reqs": run["load"].get("peak_running_reqs"),
        "peak_used_tokens": run["load"].get("peak_used_tokens"),
        "peak_token_usage": run["load"].get("peak_token_usage"),
        "radix_hit_rate": cached / prompt if prompt else None,
        "prefill_recomputed": prompt - cached,
        "retractions": sum(t.get("retractions", 0) for t in turns),
        "e2e_seconds": run["wall_seconds"],
        "ttft_p50": pct([t["ttft"] for t in turns], 0.5),
        "ttft_p99": pct([t["ttft"] for t in turns], 0.99),
        "decode_tps_per_req": mean([t["decode_tps"] for t in turns]),
        "output_tps": sum(t["completion_tokens"] for t in turns) / run["wall_seconds"]
        if run["wall_seconds"]
        else None,
        "recall_accuracy": mean([float(c) for c in recall]) if recall else None,
        "recall_n": len(recall),
        "f1_mean": mean(f1s),
        "loglik_mean": mean([s["mean"] for s in run.get("scores", {}).values() if s]),
        "compressions": run.get("totals", {}).get("compressions"),
        "policy_failures": run.get("totals", {}).get("policy_failures"),
    }
    if base is not None:
        b = {_key(t): t for t in base["turns"] if not t.get("error")}
        same = [t["answer"] == b[_key(t)]["answer"] for t in turns if _key(t) in b]
        out["greedy_agreement"] = mean([float(x) for x in same]) if same else None
        bs = summarize(base, None, pool)
        for k in (
            "kv_per_session",
            "capacity_sessions",
            "prefill_recomputed",
            "e2e_seconds",
            "output_tps",
            "recall_accuracy",
            "peak_running_reqs",
        ):
            out[f"{k}_vs_none"] = out[k] / bs[k] if out[k] is not None and bs[k] else None
        out["loglik_delta_vs_none"] = (
            out["loglik_mean"] - bs["loglik_mean"]
            if out["loglik_mean"] is not None and bs["loglik_mean"] is not None
            else None
        )
    return out


COLUMNS = [
    ("label", "policy@budget", "{}"),
    ("kv_per_session", "KV/session", "{:.0f}"),
    ("kv_per_session_vs_none", "vs none", "{:.2f}"),
    ("capacity_sessions_vs_none", "capacity x", "{:.2f}"),
    ("peak_running_reqs", "peak running", "{}"),
    ("peak_used_tokens", "peak tokens", "{}"),
    ("radix_hit_rate", "radix hit", "{:.2f}"),
    ("prefill_recomputed", "prefill recomputed", "{}"),
    ("retractions", "retracted", "{}"),
    ("e2e_seconds", "e2e s", "{:.0f}"),
    ("ttft_p50", "TTFT p50 s", "{:.2f}"),
    ("ttft_p99", "TTFT p99 s", "{:.2f}"),
    ("decode_tps_per_req", "decode tok/s/req", "{:.1f}"),
    ("output_tps", "out tok/s", "{:.1f}"),
    ("recall_accuracy", "recall", "{:.2f}"),
    ("greedy_agreement", "agree w/ none", "{:.2f}"),
    ("loglik_delta_vs_none", "dLL/token", "{:+.3f}"),
]


LONG_TURNS = (5, 10, 20, 30)


def long_markdown(summaries: list[dict]) -> str:
    """KV per session at fixed turns (mean over sessions; 1-based turns), against `none` at the last
    turn, with the recall of the early fact, speed and prefill recomputed: the long-session view."""
    n = max((len(s.get("kv_by_turn") or []) for s in summaries), default=0)
    marks = [t for t in LONG_TURNS if t < n]
    head = ["run", *(f"KV t{t}" for t in marks), f"KV last (t{n})", "branch KV last", "vs none"]
    head += ["recall", "TTFT p50 s", "decode tok/s/req", "prefill recomputed", "e2e s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        series = s.get("kv_by_turn") or []
        cells = [s["label"], *(fmt(series[t - 1] if t <= len(series) else None, "{:.0f}") for t in marks)]
        cells += [
            fmt(s.get("kv_per_session"), "{:.0f}"),
            fmt(s.get("branch_kv_per_session"), "{:.0f}"),
            fmt(s.get("kv_per_session_vs_none"), "{:.2f}"),
            f"{fmt(s.get('recall_accuracy'), '{:.2f}')} ({s.get('recall_n', 0)})",
            fmt(s.get("ttft_p50"), "{:.2f}"),
            fmt(s.get("decode_tps_per_req"), "{:.1f}"),
            fmt(s.get("prefill_recomputed"), "{}"),
            fmt(s.get("e2e_seconds"), "{:.0f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    try:
        return spec.format(v)
    except (ValueError, TypeError):
        return str(v)


def markdown(summaries: list[dict], bench: dict[str, dict] | None = None) -> str:
    lines = ["| " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for s in summaries:
        lines.append("| " + " | ".join(fmt(s.get(k), spec) for k, _, spec in COLUMNS) + " |")
    if bench:
        keys = ["completed", "duration", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms"]
        lines += [
            "",
            "SGLang `bench_serving` (generated-shared-prefix, multi-turn) on the same server:",
            "",
            "| policy@budget | " + " | ".join(keys) + " |",
            "|" + "---|" * (len(keys) + 1),
        ]
        for label, r in bench.items():
            lines.append(
                f"| {label} | "
                + " | ".join(fmt(r.get(k), "{:.2f}" if isinstance(r.get(k), float) else "{}") for k in keys)
                + (f" | {r['error']}" if "error" in r else "")
                + " |"
            )
    return "\n".join(lines) + "\n"


def _save(fig: Any, ax: Any, out: Path, name: str, xlabel: str, ylabel: str) -> str:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


STYLE = {None: ":", "request": "--", "branch": "-"}


def kv_plot(runs: list[dict], out: Path) -> str:
    """KV per session against turn (left: all it holds; right: its branch's own part, after the branch
    point), one color per policy, dashed = request scope, solid = branch scope, dotted = default."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors: dict[str, Any] = {}
    for run in runs:
        color = colors.setdefault(run["policy"], f"C{len(colors)}")
        style = "-" if run["policy"] == "none" else STYLE.get(run.get("scope"), ":")
        for ax, key in zip(axes, ("kv_tokens", "branch_kv_tokens"), strict=True):
            series = kv_by_turn(run["turns"], key)
            pts = [(i + 1, v) for i, v in enumerate(series) if v is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, color=color, marker=".", label=run["label"])
    axes[0].set_title("KV held by the session (mean over sessions)", fontsize=9)
    axes[1].set_title(
        "branch_kv_tokens: KV after the branch point (request scope, none: the new turn only)", fontsize=9
    )
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel("turn")
    axes[1].set_ylabel("branch KV tokens")
    axes[1].grid(alpha=0.3)
    return _save(fig, axes[0], out, "kv_per_turn.png", "turn", "KV tokens")


def plots(runs: list[dict], summaries: list[dict], out: Path) -> list[str]:
    """KV per session over turns, quality against memory saved, throughput per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = [kv_plot(runs, out)]

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        saved = 1 - s["kv_per_session_vs_none"] if s.get("kv_per_session_vs_none") is not None else 0.0
        q = (
            s.get("recall_accuracy")
            if s.get("recall_accuracy") is not None
            else s.get("greedy_agreement", 1.0)
        )
        if q is None:
            continue
        ax.scatter(saved, q)
        ax.annotate(s["label"], (saved, q), fontsize=7)
    files.append(
        _save(
            fig,
            ax,
            out,
            "quality_vs_memory.png",
            "KV memory saved vs none",
            "quality (recall accuracy, else agreement with none)",
        )
    )

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([s["label"] for s in summaries], [s.get("output_tps") or 0 for s in summaries])
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    files.append(_save(fig, ax, out, "throughput.png", "policy@budget", "output tokens/s (whole replay)"))
    return files


def by_kind(q: list[dict]) -> tuple[str, int]:
    """The question turns answered per kind of fact ("codes 12/12, names 0/12, budgets 12/12"), and the misses
    that gave the filler turns' answer."""
    right: dict[str, list[int]] = {}
    for t in q:
        got = right.setdefault(recall.kind(str(t["expect"])), [0, 0])
        got[0] += bool(t["correct"])
        got[1] += 1
    names = {"code": "codes", "name": "names", "number": "budgets"}
    parts = [f"{names[k]} {right[k][0]}/{right[k][1]}" for k in names if k in right]
    filler = sum(not t["correct"] and recall.gave_filler_answer(t["answer"] or "") for t in q)
    return ", ".join(parts), filler


def recall_markdown(runs: list[dict]) -> str:
    """Per run, the question turns of a recall scenario: answered (in all and per kind of fact), device
    vs logical KV, the host tier."""
    head = (
        "| run | answered | codes, names, budgets answered | misses giving the filler answer "
        "| device KV while answering / logical at the question (mean) "
        "| host tokens at the question (mean) "
        "| recalled per turn (mean entries) | bytes moved per turn (mean) |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for r in runs:
        q = [t for t in r["turns"] if t.get("expect")]
        if not q:
            continue
        ok = sum(bool(t["correct"]) for t in q)
        kinds, filler = by_kind(q)
        # the KV the answer was read over: recall may append columns for the turn, folded at its end
        kv = mean([t.get("peak_kv_tokens") or t["kv_tokens"] for t in q])
        lg = mean([t["logical_tokens"] for t in q])
        host = mean([t.get("host_tokens") for t in q])
        rec = mean([t.get("recalled") for t in r["turns"]])
        moved = mean([t.get("bytes_moved") for t in r["turns"]])
        share = f"{kv:.0f} / {lg:.0f} ({100 * kv / lg:.0f}%)" if kv is not None and lg else "-"
        rows.append(
            f"| {r['label']} | {ok} of {len(q)} | {kinds} | {filler} | {share} | {fmt(host, '{:.0f}')} | "
            f"{fmt(rec, '{:.0f}') if rec else '-'} | {f'{moved / 1e6:.2f} MB' if moved else '-'} |"
        )
    return "\n".join(rows)


def cost_markdown(runs: list[dict]) -> str:
    """Per run, what recall costs where it can act: the mean decode time per token (1 / a turn's decode
    tokens/s) and the TTFT p50 over the turns at or after the first turn whose branch had host entries in
    any run (turn index, so runs with recall off are compared on the same turns), each as a ratio to the
    runs without a host tier (`host_tokens` never reported) of the same replay."""
    hosted = [t["turn"] for r in runs for t in r["turns"] if t.get("host_tokens")]
    if not hosted:
        return "no turn had host entries: nothing to compare"
    first = min(hosted)
    rows, per_run = [], []
    for r in runs:
        ts = [
            t for t in r["turns"] if t["turn"] >= first and t.get("decode_tps") and t.get("ttft") is not None
        ]
        if not ts:
            continue
        ms = 1000 * statistics.fmean(1 / t["decode_tps"] for t in ts)
        ttft = statistics.median(t["ttft"] for t in ts)
        per_run.append((r["label"], any(t.get("host_tokens") for t in r["turns"]), len(ts), ms, ttft))
    off = [x for x in per_run if not x[1]]
    base_ms = statistics.fmean(x[3] for x in off) if off else None
    base_ttft = statistics.fmean(x[4] for x in off) if off else None
    rows.append(f"turns from {first} (the first with host entries)\n")
    rows.append(
        "| run | recall | turns | decode ms/token | x off | TTFT p50 s | x off |\n|---|---|---|---|---|---|---|"
    )
    for label, on, n, ms, ttft in per_run:
        x_ms = f"{ms / base_ms:.2f}" if base_ms else "-"
        x_ttft = f"{ttft / base_ttft:.2f}" if base_ttft else "-"
        rows.append(
            f"| {label} | {'on' if on else 'off'} | {n} | {ms:.1f} | {x_ms} | {ttft:.2f} | {x_ttft} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="tables from a replay.json")
    ap.add_argument("replay_json", type=Path)
    ap.add_argument("--recall", action="store_true", help="the recall scenario's question-turn table")
    ap.add_argument(
        "--cost",
        action="store_true",
        help="decode time per token and TTFT of each run against the runs with recall off, on the turns "
        "from the first with host entries",
    )
    a = ap.parse_args()
    data = json.loads(a.replay_json.read_text())
    if not (a.recall or a.cost):
        ap.error("choose --recall or --cost; replay.md holds the other tables")
    if a.recall:
        print(recall_markdown(data["runs"]))
    if a.cost:
        print(cost_markdown(data["runs"]))
