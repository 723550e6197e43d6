"""Replay multi-turn scenarios against a live SGLang server under several KV policies at a fixed KV pool,
and compare each with `none` from the same run: memory, speed and quality.

Why a replay: compression pays off only across turns (the compressed history is what the next turn
reuses, and what lets more sessions fit in the pool), so it must be measured on whole sessions, with
turn order kept inside a session and several sessions at once.

Per turn it records TTFT and decode tokens/s (streamed turns; --no-stream to turn off), e2e latency, prompt/cached/completion tokens, KV held
(`meta_info["kvevict"]`) and the answer; per run, peak running requests and tokens in use (sampled from
`GET /v1/loads`), the plugin's totals, and the teacher-forced log-likelihood of `none`'s answers.

Full CPU benchmark (SmolLM2-135M, 2 cores, alone on the machine; about 30-40 min; NOT run in CI):

    HF_HUB_OFFLINE=1 /root/.cache/sgl-kvevict/venv-dca1c6560ddb/bin/python benchmarks/replay.py \\
        --scenarios agent,recall --sessions 4 --turns 4 --concurrency 4 --max-new-tokens 24 \\
        --tool-tokens 300,900 --filler-tokens 200 --max-total-tokens 9000 \\
        --policies none,streaming,knorm,h2o,snapkv,lagkv,d2o,graphkv,criticalkv --budgets 0.5 \\
        --bench-serving --out results/replay-mixed

Small plumbing check (two policies, one server; ~5 min):

    HF_HUB_OFFLINE=1 /root/.cache/sgl-kvevict/venv-dca1c6560ddb/bin/python benchmarks/replay.py \\
        --scenarios agent,recall --sessions 1 --turns 2 --concurrency 2 --max-new-tokens 8 \\
        --tool-tokens 150,300 --filler-tokens 80 --system-tokens 200 --max-total-tokens 4000 \\
        --policies none,lagkv --server-mode shared --out results/smoke

Recall calibration (full cache only): `--scenarios recall --sessions 10 --policies none`.

Long sessions, request vs branch scope side by side (`--policies` entries are NAME[#VARIANT][@SCOPE][=BUDGET]:
`snapkv@request` sets the policy config's `scope`; `=BUDGET` runs that entry at that budget only;
`d2o#nomerge` is a second d2o run whose config adds `--policy-config`'s `"d2o#nomerge"` entry):

    HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/replay.py --scenarios long --plant-room 0 --sessions 2 \\
        --turns 30 --concurrency 2 --max-new-tokens 8 --system-tokens 300 --tool-tokens 50,600 \\
        --max-total-tokens 20000 --budgets 512 --server-mode shared --out results/long-sessions-request-scope \\
        --policies none,snapkv@request,snapkv@branch,lagkv@request,lagkv@branch,d2o@branch,snapkv@request=0.5,snapkv@branch=0.5

Every turn records the KV the session holds (`kv_tokens`) and its branch's own part (`branch_kv_tokens`);
replay.md adds a table of KV at turns 5/10/20/30/last and kv_per_turn.png plots both against the turn.
Each session's system block is declared as the policy config's `shared_prefix` (`--no-shared-prefix`:
not), so branch scope never compresses the prompt all sessions share.

Server modes: `per-run` starts a fresh server for every policy/budget (`none` is then plain SGLang),
`shared` starts one server with a policy and picks each run's policy per request (`custom_params`;
faster, and `none` still goes through the plugin's tree), `url` uses a running server (`--url`).
On a GPU, scale every size flag up (sessions, turns, tool tokens, --max-total-tokens) and pass
`--server-arg=--model-path=...`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tqdm import tqdm

from sgl_kvevict.scenarios import BUILDERS, build
from sgl_kvevict.scenarios.base import Scenario, ScenarioConfig, Session, Turn
from sgl_kvevict.scenarios.locomo import f1
from sgl_kvevict.scenarios.recall import correct

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replay_client as rc  # noqa: E402
import replay_report as rr  # noqa: E402

ALL_POLICIES = ["none", "streaming", "knorm", "h2o", "snapkv", "lagkv", "d2o", "graphkv", "criticalkv"]


class BenchConfig(BaseModel):
    """Everything a replay run depends on; saved in the result file so a run can be repeated."""

    model_config = ConfigDict(extra="forbid")

    scenarios: list[str] = ["agent", "recall"]
    scenario: ScenarioConfig = Field(default_factory=ScenarioConfig)
    concurrency: int = Field(4, ge=1, description="sessions replayed at once")
    max_new_tokens: int = Field(24, ge=1, description="answer length cap per turn")
    policies: list[str] = Field(default_factory=lambda: list(ALL_POLICIES))
    policy_configs: dict[str, dict] = Field(
        default_factory=dict,
        description='per-policy config, e.g. {"lagkv": {"lag": 32}} (--kv-policy-config)',
    )
    budgets: list[float | int] = [0.5]
    max_total_tokens: int = Field(
        9000, ge=256, description="KV pool: small enough to pressure the full cache"
    )
    server_mode: Literal["per-run", "shared", "url"] = "per-run"
    url: str | None = None
    worker_urls: list[str] = Field(
        default_factory=list, description="with --url of a router: its workers, for the plugin's counters"
    )
    routing_key: bool = Field(False, description="send each session's id in sglang-router's session header")
    baseline: bool = Field(True, description="run `none` first (off: only --policies, e.g. behind a router)")
    shared_policy: str = Field("lagkv", description="policy the shared server starts with (runs override it)")
    server_args: list[str] = Field(default_factory=list)
    server_env: dict[str, str] = Field(default_factory=dict)
    stream: bool = Field(True, description="stream turns, for TTFT and decode tokens/s")
    score: Literal["none", "last", "all"] = Field(
        "last", description="turns scored by teacher-forced LL of none's answer"
    )
    bench_serving: bool = False
    bench_serving_args: list[str] = Field(
        default_factory=lambda: [
            "--gsp-num-groups",
            "2",
            "--gsp-prompts-per-group",
            "2",
            "--gsp-system-prompt-len",
            "600",
            "--gsp-question-len",
            "200",
            "--gsp-output-len",
            "24",
            "--gsp-num-turns",
            "3",
            "--num-prompts",
            "4",
            "--max-concurrency",
            "4",
        ]
    )
    declare_shared_prefix: bool = Field(
        True,
        description="send each session's system block as the policy config's shared_prefix, so branch "
        "scope never compresses the prompt every session shares",
    )
    poll_interval: float = Field(1.0, gt=0)
    model_path: str | None = None
    out: Path = Path("results/replay")

    @field_validator("policies")
    @classmethod
    def _specs(cls, v: list[str]) -> list[str]:
        for text in v:
            parse_spec(text)
        return v


SCOPES = ("request", "branch")


class RunSpec(BaseModel):
    """One `--policies` entry: `NAME[@SCOPE][=BUDGET]`, e.g. `snapkv`, `snapkv@request`,
    `snapkv@branch=1024`. SCOPE sets the policy config's `scope` (omitted: the server's default);
    BUDGET runs this entry at that budget only, instead of at each of `--budgets`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str
    variant: str | None = None
    scope: Literal["request", "branch"] | None = None
    budget: float | int | None = None

    @property
    def variant_name(self) -> str:
        return self.policy if self.variant is None else f"{self.policy}#{self.variant}"

    @property
    def name(self) -> str:
        return self.variant_name if self.scope is None else f"{self.variant_name}@{self.scope}"


def parse_spec(text: str) -> RunSpec:
    """Parse and validate one policy spec; the error names the valid policies / scopes."""
    from sgl_kvevict.config import parse_budget
    from sgl_kvevict.policies import available

    raw = text.strip()
    head, eq, budget_text = raw.partition("=")
    policy, at, scope = head.partition("@")
    policy, hash_, variant = policy.partition("#")
    if hash_ and not variant.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"policy spec {text!r}: a variant is letters, digits, '-' or '_' (NAME#VARIANT)")
    valid = available()
    if policy not in valid:
        raise ValueError(
            f"policy spec {text!r}: unknown policy {policy!r}; valid: {', '.join(valid)} "
            "(syntax NAME[@SCOPE][=BUDGET], e.g. snapkv@branch=512)"
        )
    if at and scope not in SCOPES:
        raise ValueError(
            f"policy spec {text!r}: unknown scope {scope!r}; valid: {', '.join(SCOPES)} "
            "(syntax NAME[@SCOPE][=BUDGET])"
        )
    if policy == "none" and (at or eq):
        raise ValueError(f"policy spec {text!r}: 'none' takes no scope or budget")
    budget = None
    if eq:
        try:
            budget = parse_budget(budget_text)
        except ValueError as e:
            raise ValueError(f"policy spec {text!r}: {e}") from None
    return RunSpec(policy=policy, variant=variant or None, scope=scope or None, budget=budget)


class Run(BaseModel):
    """One replay of every session under one policy, scope and budget."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: RunSpec
    budget: float | int | None

    @property
    def label(self) -> str:
        return label(self.spec.name, self.budget)


def runs_of(cfg: BenchConfig) -> list[Run]:
    """`none` first (the baseline every other run is compared with), then each spec x budget (a spec
    with its own budget runs once)."""
    out = [Run(spec=RunSpec(policy="none"), budget=None)] if cfg.baseline or "none" in cfg.policies else []
    for text in cfg.policies:
        spec = parse_spec(text)
        if spec.policy == "none":
            continue
        budgets = [spec.budget] if spec.budget is not None else cfg.budgets
        out += [Run(spec=spec, budget=b) for b in budgets]
    labels = [r.label for r in out]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"--policies names the same run twice: {', '.join(dup)}")
    return out


def label(policy: str, budget: float | int | None) -> str:
    return policy if budget is None else f"{policy}@{budget}"


def policy_config(cfg: BenchConfig, spec: RunSpec) -> dict[str, Any]:
    """The run's policy config: `--policy-config` by policy name, then by variant (`d2o#nomerge`), then by
    spec name (`snapkv@branch`), then the spec's scope."""
    out = {**cfg.policy_configs.get(spec.policy, {})}
    if spec.variant is not None:
        out.update(cfg.policy_configs.get(spec.variant_name, {}))
    if spec.scope is not None:
        out.update(cfg.policy_configs.get(spec.name, {}))
        out["scope"] = spec.scope
    return out


def load_scenarios(cfg: BenchConfig) -> list[Session]:
    sessions: list[Session] = []
    scs: list[Scenario] = [build(name, cfg.scenario) for name in cfg.scenarios]
    for i in range(max(len(s.sessions) for s in scs)):  # interleave kinds so each batch mixes them
        sessions += [s.sessions[i] for s in scs if i < len(s.sessions)]
    return sessions


class Replayer:
    """Replays all sessions under one policy; keeps the prompt ids for the scoring phase."""

    def __init__(
        self, cfg: BenchConfig, chat: rc.ChatIds, url: str, kv: dict | None, bar: tqdm, tag: str = ""
    ) -> None:
        self.cfg, self.chat, self.url, self.kv, self.bar = cfg, chat, url, kv, bar
        self.tag = tag  # run label: a session's routing key is new in every run
        self.records: list[dict[str, Any]] = []
        self.prompts: dict[tuple[str, int, int], list[int]] = {}
        self.kvs: dict[str, dict | None] = {}  # per session: the override actually sent
        self.lock = threading.Lock()

    def kv_for(self, s: Session) -> dict | None:
        """The run's override; for a compressing policy, with the session's system block declared as
        `shared_prefix` (the prompt every session shares: branch scope must not compress it)."""
        if not self.kv or self.kv.get("policy", "none") == "none" or not self.cfg.declare_shared_prefix:
            return self.kv
        config = {"shared_prefix": len(self.chat.start(s.system)), **self.kv.get("config", {})}
        return {**self.kv, "config": config}

    def _record(self, s: Session, t: int, b: int, prompt: list[int], call: rc.Call, turn: Turn) -> None:
        meta = call.meta
        reference = turn.references[b] if turn.references else None
        expect = turn.expect if reference is None else reference
        stats = (meta.get("kvevict") or [None])[-1]
        kv_tokens = stats["kv_tokens"] if stats else None
        sent = (self.kv or {}).get("policy", "none")
        got = stats.get("policy", "none") if stats else "none"
        if self.kv and not call.error and got != sent:  # a proxy dropped custom_params on the way
            call.error = (
                f"override not applied: sent policy {sent!r}, the server ran {got!r} "
                "(sglang-router drops custom_params: start the workers with the policy instead)"
            )
        if (
            kv_tokens is None
            and not call.error
            and (self.kv or {}).get("policy", "none") == "none"
            and self.cfg.server_mode != "shared"
        ):
            kv_tokens = int(meta.get("prompt_tokens", 0)) + int(
                meta.get("completion_tokens", 0)
            )  # plain SGLang keeps every token
        rec = {
            "session": s.id,
            "kind": s.kind,
            "turn": t,
            "branch": b,
            "prompt_tokens": int(meta.get("prompt_tokens", len(prompt))),
            "cached_tokens": int(meta.get("cached_tokens", 0)),
            "completion_tokens": int(meta.get("completion_tokens", 0)),
            "kv_tokens": kv_tokens,
            "kv_source": "meta_info" if stats else ("full" if kv_tokens is not None else "missing"),
            "branch_kv_tokens": stats.get("branch_kv_tokens") if stats else None,
            "prefix_kv_tokens": stats.get("prefix_kv_tokens") if stats else None,
            "logical_tokens": stats.get("logical_tokens") if stats else None,
            "reused_evicted": stats.get("reused_evicted") if stats else None,
            "evicted": stats.get("evicted") if stats else None,
            "compressions": stats.get("compressions") if stats else None,
            "policy_failed": stats.get("failed") if stats else None,
            # host tier (--kv-recall-tokens): entries swapped back this turn, bytes moved, branch host columns
            "recalled": stats.get("recalled") if stats else None,
            "bytes_moved": stats.get("bytes_moved") if stats else None,
            "host_tokens": stats.get("host_tokens") if stats else None,
            "host_borrowed": stats.get("host_borrowed") if stats else None,  # read its history in place
            "peak_kv_tokens": stats.get("peak_kv_tokens") if stats else None,  # what the answer read over
            "retractions": int(meta.get("num_retractions", 0) or 0),
            "ttft": call.ttft,
            "decode_tps": call.decode_tps,
            "e2e": call.e2e,
            "start": call.start,
            "end": call.end,
            "answer": call.text,
            "output_ids": call.output_ids,
            "expect": expect,
            "correct": correct(call.text, expect) if turn.expect is not None and reference is None else None,
            "f1": f1(call.text, reference) if reference is not None else None,
            "error": call.error,
        }
        with self.lock:
            self.records.append(rec)
            self.prompts[(s.id, t, b)] = prompt
            self.bar.update(1)

    def session(self, s: Session) -> None:
        if s.api == "chat":
            return self.chat_session(s)
        chat, cfg = self.chat, self.cfg
        kv = self.kv_for(s)
        with self.lock:
            self.kvs[s.id] = kv
        ids = chat.start(s.system)
        key = f"{self.tag}/{s.id}" if cfg.routing_key else None
        for t, turn in enumerate(s.turns):
            for m in turn.inputs:
                ids = ids + chat.message(m.role, m.content)
            mnt = turn.answer_cap(cfg.max_new_tokens)
            prompts = [
                ids + sum((chat.message(m.role, m.content) for m in br), []) + chat.gen_prompt
                for br in turn.branches
            ] or [ids + chat.gen_prompt]
            calls = self._each(
                prompts, lambda p, n=mnt: rc.generate(self.url, p, n, kv, cfg.stream, routing_key=key)
            )
            for b, (p, c) in enumerate(zip(prompts, calls, strict=True)):
                self._record(s, t, b, p, c, turn)
            if calls[0].error:
                return
            if turn.reply == "":  # the client drops the answer: the next message follows this one
                continue
            answer = chat.encode(turn.reply) + chat.end_ids if turn.reply is not None else None
            ids = prompts[0] + (answer or chat.after_answer(calls[0].output_ids))

    def chat_session(self, s: Session) -> None:
        """A session through the OpenAI chat API: the history is messages, the server renders them."""
        kv = self.kv_for(s)
        with self.lock:
            self.kvs[s.id] = kv
        msgs = [{"role": "system", "content": s.system}] if s.system is not None else []
        for t, turn in enumerate(s.turns):
            msgs = msgs + [{"role": m.role, "content": m.content} for m in turn.inputs]
            mnt = turn.answer_cap(self.cfg.max_new_tokens)
            asks = [msgs + [{"role": m.role, "content": m.content} for m in br] for br in turn.branches] or [
                msgs
            ]
            calls = self._each(asks, lambda m, n=mnt: rc.chat(self.url, m, n, kv))
            for b, c in enumerate(calls):
                self._record(s, t, b, [], c, turn)
            if calls[0].error:
                return
            if turn.reply == "":  # the client drops the answer: the next message follows this one
                msgs = asks[0]
                continue
            reply = turn.reply if turn.reply is not None else calls[0].text
            msgs = asks[0] + [{"role": "assistant", "content": reply}]

    @staticmethod
    def _each(prompts: list[Any], call: Any) -> list[rc.Call]:
        """One call per prompt; a fork's branches are sent at once."""
        if len(prompts) == 1:
            return [call(prompts[0])]
        with ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(call, prompts))

    def run(self, sessions: list[Session]) -> float:
        t0 = time.time()
        with ThreadPoolExecutor(self.cfg.concurrency) as ex:
            list(ex.map(self.session, sessions))
        return time.time() - t0


def score(
    cfg: BenchConfig,
    url: str,
    kvs: dict[str, dict | None],
    prompts: dict,
    base: dict[tuple, list[int]],
    sessions: list[Session],
) -> dict[str, Any]:
    """Teacher-forced log-likelihood of none's answer after this policy's own prompt (untimed)."""
    if cfg.score == "none":
        return {}
    last = {s.id: len(s.turns) - 1 for s in sessions}
    keys = [
        k
        for k in prompts
        if prompts[k] and k[2] == 0 and (cfg.score == "all" or k[1] == last[k[0]]) and base.get(k)
    ]
    out = {}
    for k in tqdm(sorted(keys), desc="score", file=sys.stderr, leave=False):
        out["/".join(map(str, k))] = rc.loglik(url, prompts[k], base[k], kvs.get(k[0]))
    return out


def warmup(url: str, chat: rc.ChatIds, kv: dict | None) -> None:
    """The first forward passes of a fresh server are several times slower (lazy init): keep them out of
    the first measured run, then flush so no run starts with a warm prefix."""
    ids = chat.start("warm up") + chat.message("user", " ".join(["warm"] * 300)) + chat.gen_prompt
    for _ in range(2):
        rc.generate(url, ids, 8, kv, stream=False)
    rc.flush(url)


def start_server(cfg: BenchConfig, spec: RunSpec, budget: float | int | None, log: Path) -> Any:
    from sgl_kvevict.serve.serverproc import Server

    args = ["--kv-policy", spec.policy, "--max-total-tokens", str(cfg.max_total_tokens), *cfg.server_args]
    if budget is not None:
        args += ["--kv-budget", str(budget)]
    if policy_config(cfg, spec):
        args += ["--kv-policy-config", json.dumps(policy_config(cfg, spec))]
    if cfg.model_path:
        args += ["--model-path", cfg.model_path]
    return Server(args, log_path=log, env=cfg.server_env)


def git_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
            ).stdout.strip()
            or None
        )
    except OSError:
        return None


def write(
    cfg: BenchConfig, model: str, runs: list[dict], bench: dict, final: bool
) -> tuple[dict[str, Any], str]:
    """Write replay.json and replay.md for the runs so far (`partial` until the last run is done)."""
    base = runs[0] if runs and runs[0]["policy"] == "none" else None
    summaries = [rr.summarize(r, base if r is not base else None, cfg.max_total_tokens) for r in runs]
    result = {
        "config": json.loads(cfg.model_dump_json()),
        "model": model,
        "git_commit": git_commit(),
        "command": " ".join(sys.argv),
        "summary": summaries,
        "bench_serving": bench,
        "runs": runs,
        "partial": not final,
    }
    (cfg.out / "replay.json").write_text(json.dumps(result, indent=1))
    table = rr.markdown(summaries, bench or None)
    table += "\nKV per session by turn (mean over sessions; `vs none` at the last turn):\n\n"
    table += rr.long_markdown(summaries)
    (cfg.out / "replay.md").write_text(f"Command: `{result['command']}`\n\n" + table)
    rr.plots(runs, summaries, cfg.out)
    return result, table


def main(cfg: BenchConfig) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from sgl_kvevict.model import default_model_path

    model = cfg.model_path or str(default_model_path())
    chat = rc.ChatIds(AutoTokenizer.from_pretrained(model))
    sessions = load_scenarios(cfg)
    n_requests = sum(max(1, len(t.branches)) for s in sessions for t in s.turns)
    cfg.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    bench: dict[str, dict] = {}
    base_ids: dict[tuple, list[int]] = {}
    with ExitStack() as stack:
        shared_url = cfg.url
        if cfg.server_mode == "shared":
            shared_url = stack.enter_context(
                start_server(cfg, RunSpec(policy=cfg.shared_policy), None, cfg.out / "server-shared.log")
            ).url
        for run in runs_of(cfg):
            policy, budget, name = run.spec.policy, run.budget, run.label
            with ExitStack() as run_stack:
                kv: dict | None = (
                    {"policy": policy} if budget is None else {"policy": policy, "budget": budget}
                )
                conf = policy_config(cfg, run.spec)
                recall = conf.pop("recall_tokens", None)  # a request setting, beside the policy config
                if conf:
                    kv["config"] = conf
                if recall is not None:
                    kv["recall_tokens"] = recall
                if cfg.server_mode == "per-run":
                    url = run_stack.enter_context(
                        start_server(cfg, run.spec, budget, cfg.out / f"server-{name}.log")
                    ).url
                    if policy == "none":
                        kv = None  # plain SGLang: the server refuses compressing overrides
                else:
                    assert shared_url, "--url is required with --server-mode url"
                    url = shared_url
                    rc.flush(url)
                before = rc.cluster_totals(cfg.worker_urls or [url])
                bar = tqdm(total=n_requests, desc=name, file=sys.stderr)
                rep = Replayer(cfg, chat, url, kv, bar, tag=name)
                with rc.LoadPoller(url, cfg.poll_interval) as poller:
                    wall = rep.run(sessions)
                bar.close()
                after = rc.cluster_totals(cfg.worker_urls or [url])
                totals = {
                    k: after[k] - before.get(k, 0)
                    for k in after
                    if isinstance(after[k], int | float) and k != "started"
                }
                if policy == "none":
                    base_ids = {
                        (r["session"], r["turn"], r["branch"]): r["output_ids"]
                        for r in rep.records
                        if not r["error"]
                    }
                scores = score(cfg, url, rep.kvs, rep.prompts, base_ids, sessions)
                if cfg.bench_serving:
                    rc.flush(url)
                    bench[name] = rc.bench_serving(
                        url,
                        model,
                        cfg.out / f"bench_serving-{name}.jsonl",
                        cfg.bench_serving_args,
                        kv,
                        cfg.scenario.seed,
                    )
                records = sorted(rep.records, key=lambda r: (r["session"], r["turn"], r["branch"]))
                runs.append(
                    {
                        "label": name,
                        "policy": policy,
                        "scope": run.spec.scope,
                        "budget": budget,
                        "kv_override": kv,
                        "wall_seconds": wall,
                        "load": poller.summary(),
                        "totals": totals,
                        "scores": scores,
                        "turns": records,
                    }
                )
                write(cfg, model, runs, bench, final=False)  # a stopped replay keeps its finished runs
    result, table = write(cfg, model, runs, bench, final=True)
    print(table)
    return result


def parse(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--scenarios",
        default="agent,recall",
        help="comma list of: " + ", ".join(BUILDERS),
    )
    p.add_argument(
        "--scenario-path",
        help="sharegpt: a ShareGPT/OpenAI-messages JSON or JSONL file; locomo: LoCoMo's locomo10.json or folder",
    )
    p.add_argument(
        "--conversations", default="6-10", help="locomo: conversations to replay (1-5 are held out)"
    )
    p.add_argument("--questions", type=int, default=12, help="locomo: questions per window at most")
    p.add_argument(
        "--windows",
        type=int,
        default=1,
        help="locomo: consecutive stretches of each conversation, one session each",
    )
    p.add_argument("--sessions", type=int, default=4, help="sessions per scenario")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument(
        "--tool-tokens", default="300,2000", help="min,max tokens of a tool output / forks document"
    )
    p.add_argument("--filler-tokens", type=int, default=200)
    p.add_argument("--branches", type=int, default=3)
    p.add_argument(
        "--question-forks",
        type=int,
        default=1,
        help="recall: ask the question as a fork of this many branches off one history (1-4)",
    )
    p.add_argument(
        "--plant-room",
        type=int,
        default=16,
        help="recall, long: answer tokens the plant's turn gets at least, whatever --max-new-tokens (0: none)",
    )
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument(
        "--policies",
        default=",".join(ALL_POLICIES),
        help="comma list of NAME[@SCOPE][=BUDGET]: snapkv, snapkv@request, snapkv@branch=1024 "
        "(SCOPE request|branch sets the config's scope; =BUDGET runs that entry at that budget only)",
    )
    p.add_argument(
        "--policy-config", default="{}", help='JSON: per-policy config, e.g. \'{"lagkv": {"lag": 32}}\''
    )
    p.add_argument("--budgets", default="0.5", help="comma list: ratios (0.5) or tokens (256)")
    p.add_argument("--max-total-tokens", type=int, default=9000)
    p.add_argument("--server-mode", choices=["per-run", "shared", "url"], default="per-run")
    p.add_argument("--url", help="with --server-mode url: a running server or sglang-router")
    p.add_argument(
        "--worker-urls", default="", help="comma list: the router's workers (for the plugin's counters)"
    )
    p.add_argument(
        "--routing-key",
        action="store_true",
        help="send each session's id as sglang-router's X-SMG-Routing-Key",
    )
    p.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="do not add the `none` run (when the server's own policy is the one measured)",
    )
    p.add_argument("--shared-policy", default="lagkv")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra server flag, e.g. --server-arg=--max-running-requests=8",
    )
    p.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="non-streamed turns (no TTFT / decode rate); streamed by default",
    )
    p.add_argument("--score", choices=["none", "last", "all"], default="last")
    p.add_argument(
        "--bench-serving", action="store_true", help="also run sglang.benchmark.serving per policy"
    )
    p.add_argument("--model-path")
    p.add_argument(
        "--no-shared-prefix",
        dest="declare_shared_prefix",
        action="store_false",
        help="do not declare each session's system block as shared_prefix",
    )
    p.add_argument("--out", default="results/replay")
    a = p.parse_args(argv)
    try:
        cfg = _config(a)
        runs_of(cfg)
    except (ValueError, ValidationError) as e:
        msg = e.errors()[0]["msg"].removeprefix("Value error, ") if isinstance(e, ValidationError) else str(e)
        p.error(msg)  # exit 2, one line
    return cfg


def _config(a: argparse.Namespace) -> BenchConfig:
    from sgl_kvevict.config import parse_budget

    lo, hi = (int(x) for x in a.tool_tokens.split(","))
    return BenchConfig(
        scenarios=a.scenarios.split(","),
        scenario=ScenarioConfig(
            sessions=a.sessions,
            turns=a.turns,
            seed=a.seed,
            system_tokens=a.system_tokens,
            tool_tokens_min=lo,
            tool_tokens_max=hi,
            filler_tokens=a.filler_tokens,
            branches=a.branches,
            question_forks=a.question_forks,
            plant_room=a.plant_room,
            path=a.scenario_path,
            conversations=a.conversations,
            questions=a.questions,
            windows=a.windows,
        ),
        concurrency=a.concurrency,
        max_new_tokens=a.max_new_tokens,
        policies=a.policies.split(","),
        policy_configs=json.loads(a.policy_config),
        budgets=[parse_budget(b) for b in a.budgets.split(",")],
        max_total_tokens=a.max_total_tokens,
        server_mode=a.server_mode,
        url=a.url,
        worker_urls=[u for u in a.worker_urls.split(",") if u],
        routing_key=a.routing_key,
        baseline=a.baseline,
        shared_policy=a.shared_policy,
        server_args=[x for arg in a.server_arg for x in arg.split("=", 1)] if a.server_arg else [],
        stream=a.stream,
        score=a.score,
        bench_serving=a.bench_serving,
        declare_shared_prefix=a.declare_shared_prefix,
        model_path=a.model_path,
        out=Path(a.out),
    )


if __name__ == "__main__":
    main(parse())
