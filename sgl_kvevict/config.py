"""User-facing configuration: the server-wide KV policy and the per-request override, both validated.

Server-wide settings come from `--kv-policy`, `--kv-budget`, `--kv-policy-config`. They travel from the
launcher to the scheduler process in the environment variable `KVEVICT_SERVER_CONFIG` (SGLang drops unknown
CLI fields and its `ServerArgs` is a frozen-schema msgspec struct).
A request may override them with `custom_params={"kvevict": {"policy": ..., "budget": ..., "config": {...}}}`.
What a request may override is the operator's call (`--kv-disable-request-override`,
`--kv-override-policies`, `--kv-override-min-budget`) plus what the server cannot run (CriticalKV on a
quantized `o_proj`): `ServerSettings`, carried in `KVEVICT_SERVER_SETTINGS`. It is a separate model because
`KvConfig` is also what a request sends.
"""

from __future__ import annotations

import json
import os
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from sgl_kvevict import policies
from sgl_kvevict.policies import short

ENV_VAR = "KVEVICT_SERVER_CONFIG"
SETTINGS_ENV_VAR = "KVEVICT_SERVER_SETTINGS"
REQUEST_KEY = "kvevict"
DEFAULT_BUDGET = 0.5


MAX_BUDGET_TOKENS = 1 << 24
MAX_STEP_TOKENS = 1 << 24
MAX_RECALL_TOKENS = 4096  # bound on --kv-recall-tokens and a request's recall_tokens (per layer and head)
MAX_HOST_TOKENS = 1 << 21  # bound on --kv-host-tokens (host columns)
DEFAULT_HOST_TOKENS = 16384
MAX_RECALL_PAGE = 256  # bound on --kv-recall-page (host columns per page)
MAX_RECALL_EVERY = 4096  # bound on --kv-recall-every (decode steps)
MAX_RECALL_FETCH_PAGES = 4096  # bound on --kv-recall-fetch-pages (pages per layer and KV head)
DEFAULT_RECALL_PAGE = 8
# A recall picks among the pages its summaries rank best: in a history of hundreds of pages, 64 candidate
# pages per layer and head found 7 of 12 planted facts where 8 (16 for a turn's R) found 2, and scoring
# every key 6 (the long recall replay, 225 pages per layer and head); a decode step then reads 64 pages.
DEFAULT_RECALL_FETCH_PAGES = 64
DEFAULT_RECALL_EVERY = 1  # the step's own query finds what the token it produces needs (measured)
# A host page comes back only where a query gives its best entry at least this much attention: weaker
# evidence swapped entries back and forth (3-5x the bytes moved) and answered no better (measured).
DEFAULT_RECALL_MIN_SCORE = 0.05
MAX_CAPTURE = 4096  # bound on --kv-capture-window and --kv-capture-slots (the buffer is their product)
_BUDGET_FORMS = 'tokens (e.g. 256), a percent of the suffix (e.g. "50%"), or {"tokens": N} / {"ratio": R}'
_AMBIGUOUS_ONE = (
    'budget 1 is ambiguous (a JSON encoder may write the ratio 1.0 as 1): write "100%" (or {"ratio": 1}) to '
    'keep everything, or {"tokens": 1} if one token is really meant'
)


def _tokens(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"budget tokens must be an integer, got {short(v)}")
    if not 1 <= v <= MAX_BUDGET_TOKENS:
        raise ValueError(f"budget tokens {short(v)} out of range: must be in [1, {MAX_BUDGET_TOKENS}]")
    return v


def _ratio(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"budget ratio must be a number, got {short(v)}")
    if not 0.0 < v <= 1.0:  # NaN fails this too
        raise ValueError(f"budget ratio {short(v)} out of range: must be in (0, 1]")
    return float(v)


def parse_budget(value: Any) -> int | float:
    """A budget in any accepted spelling -> its one normalized value: `int` tokens or `float` ratio.

    Why the care: `budget: 1` (one token) and `budget: 1.0` (everything) differ only in a decimal point
    that many JSON encoders drop, so the bare `1` is refused and unambiguous spellings exist:
    `{"tokens": N}` (N in [1, 2**24]), `{"ratio": R}` (R in (0, 1]), `"P%"` (P in (0, 100]); the old forms
    stay where they are unambiguous: an integer >= 2 (or an integral float > 1) is tokens, a float in
    (0, 1] is a ratio (`1.0` only as a float or the text "1.0", never the integer 1 or the text "1").
    Equal budgets written differently normalize equal (`"50%"`, `0.5`, `{"ratio": 0.5}` -> `0.5`), so the
    fingerprint of a compressed history does not depend on the spelling. Raises ValueError.
    """
    if isinstance(value, bool):
        raise ValueError(f"budget must be {_BUDGET_FORMS}, not a boolean")
    if isinstance(value, dict):
        if len(value) != 1 or next(iter(value)) not in ("tokens", "ratio"):
            keys = sorted(short(k, 20) for k in value)
            raise ValueError(f'budget object must have exactly one key, "tokens" or "ratio"; got {keys}')
        ((key, v),) = value.items()
        return _tokens(v) if key == "tokens" else _ratio(v)
    if isinstance(value, str):
        s = value.strip()
        if len(s) > 64:
            raise ValueError(f"budget {short(value)} is too long: give {_BUDGET_FORMS}")
        if s.startswith("{"):
            try:
                obj = json.loads(s)
            except json.JSONDecodeError:
                raise ValueError(f"budget {short(value)} is not valid JSON: give {_BUDGET_FORMS}") from None
            return parse_budget(obj)
        if s.endswith("%"):
            try:
                pct = Decimal(s[:-1].strip())
            except InvalidOperation:
                raise ValueError(f'budget {short(value)} is not a percent: give e.g. "50%"') from None
            if not pct.is_finite() or not 0 < pct <= 100:
                raise ValueError(f"budget {short(value)} out of range: a percent must be in (0%, 100%]")
            return float(pct / 100)
        if s == "1":
            raise ValueError(_AMBIGUOUS_ONE)
        try:
            val: int | float = int(s)
        except ValueError:
            try:
                val = float(s)
            except ValueError:
                raise ValueError(f"budget {short(value)} is not a number: give {_BUDGET_FORMS}") from None
    elif isinstance(value, (int, float)):
        val = value
    else:
        raise ValueError(f"budget must be {_BUDGET_FORMS}, got {type(value).__name__}")
    if isinstance(val, int):
        if val == 1:
            raise ValueError(_AMBIGUOUS_ONE)
        if val < 1:
            raise ValueError(f"budget {short(val)} out of range: give tokens >= 2, or a ratio in (0, 1]")
        return _tokens(val)
    if val != val or val in (float("inf"), float("-inf")):
        raise ValueError(f"budget {val} is not a finite number: give {_BUDGET_FORMS}")
    if val > 1.0 and val.is_integer():
        return _tokens(int(val))
    if not 0.0 < val <= 1.0:
        raise ValueError(
            f'budget {short(val)} out of range: a ratio must be in (0, 1] (or "P%"), tokens an integer >= 2'
        )
    return float(val)


def spelling(budget: int | float) -> int | float | dict[str, int]:
    """A normalized budget written so that `parse_budget` reads it back unchanged: one token is
    `{"tokens": 1}` (the bare 1 is refused), anything else is itself."""
    return {"tokens": 1} if isinstance(budget, int) and budget == 1 else budget


class KvConfig(BaseModel):
    """Which policy compresses a request, with what budget and policy config."""

    model_config = ConfigDict(extra="forbid")

    policy: str = "none"
    budget: int | float = Field(
        DEFAULT_BUDGET,
        description="tokens kept per head beyond sinks+recent (int), or a ratio of the suffix (float); "
        "see parse_budget for the spellings a user may write",
    )
    config: dict[str, Any] = Field(default_factory=dict)
    recall_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_RECALL_TOKENS,
        description="host entries per layer and KV head a turn may bring back (None: the server's "
        "--kv-recall-tokens; 0: no recall); at most the server's",
    )

    @field_validator("recall_tokens", mode="before")
    @classmethod
    def _recall(cls, v: Any) -> Any:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"must be an integer in [0, {MAX_RECALL_TOKENS}], got {short(v)}")
        return v

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v: Any) -> int | float:
        return parse_budget(v)

    @field_serializer("budget")
    def _dump_budget(self, v: int | float) -> int | float | dict[str, int]:
        return spelling(v)

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in policies.REGISTRY:
            raise ValueError(
                f"unknown KV policy {short(v)}; valid choices: {', '.join(policies.available())}"
            )
        return v

    def build(self) -> policies.Policy:
        """Validate the policy config too (raises PolicyConfigError naming the field).

        A ratio budget also sets LagKV's per-partition retention when its config asks (`ratio_from_budget`).

        Attention-based policies score with the last `window` queries against the request's keys under a
        causal mask that puts those queries on the last `window` slots of the row. That holds only while
        the recent window, never evicted, covers them: `window <= recent`.
        """
        pol = policies.build(self.policy, self.config)
        if isinstance(self.budget, float) and self.budget < 1.0:
            pol = pol.for_budget_ratio(self.budget)  # LagKV: a ratio budget may be its per-partition ratio
        c = pol.config
        if "attn" in pol.needs and c.window > c.recent:
            raise policies.PolicyConfigError(
                f"invalid config for KV policy {self.policy!r}: field 'window' ({c.window}) must be <= "
                f"'recent' ({c.recent}): the scored queries must be among the never-evicted recent tokens"
            )
        return pol

    def resolve_budget(self, suffix_tokens: int, always_kept: int = 0) -> int:
        """Candidate tokens to keep per head, beyond the `always_kept` sinks and recent window.

        Tokens: exactly that many beyond the windows. A ratio: of the request's own (unshared) tokens,
        windows included, so that a request holds about `ratio` of its suffix once it is long enough.
        """
        if isinstance(self.budget, int):
            return self.budget
        return max(0, int(round(self.budget * suffix_tokens)) - always_kept)

    def to_env(self) -> str:
        return self.model_dump_json()

    @property
    def active(self) -> bool:
        return self.policy != "none"


class OverridePolicy(BaseModel):
    """What the operator lets a request override (`custom_params.kvevict`).

    The server's own policy and budget are always allowed. A budget is judged only against a minimum of
    the same kind: tokens against `min_budget_tokens`, a ratio against `min_budget_ratio`. A request
    budget of a kind the operator gave no minimum for is denied when the operator gave a minimum of the
    other kind (a ratio cannot be compared with a token count before the request's length is known).
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    policies: list[str] | None = Field(None, description="policies an override may name; None: all")
    min_budget_tokens: int | None = Field(None, ge=1, le=MAX_BUDGET_TOKENS)
    min_budget_ratio: float | None = Field(None, gt=0.0, le=1.0)

    @field_validator("policies")
    @classmethod
    def _known(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("give at least one policy name")
        bad = [p for p in v if p not in policies.REGISTRY]
        if bad:
            raise ValueError(
                f"unknown KV policy {bad[0]!r}; valid choices: {', '.join(policies.available())}"
            )
        return sorted(set(v))

    @property
    def has_min_budget(self) -> bool:
        return self.min_budget_tokens is not None or self.min_budget_ratio is not None


class ServerSettings(BaseModel):
    """Server-wide rules for per-request overrides, known to every process (HTTP and scheduler)."""

    model_config = ConfigDict(extra="forbid")

    overrides: OverridePolicy = Field(default_factory=OverridePolicy)
    quantization: str | None = Field(
        None, description="how the weights are quantized (which flag), if at all"
    )
    step_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_STEP_TOKENS,
        description="region tokens compressed per scheduler step (--kv-compress-step-tokens); beyond it "
        "the other requests' compressions wait for the next steps; None: no cap",
    )

    capture_window: int | None = Field(
        None,
        ge=1,
        le=MAX_CAPTURE,
        description="the most window queries a request may score with (--kv-capture-window); None: no "
        "request of this server captures queries",
    )
    capture_slots: int = Field(
        128,
        ge=1,
        le=MAX_CAPTURE,
        description="requests that can capture window queries at once (--kv-capture-slots)",
    )

    recall_tokens: int = Field(
        0,
        ge=0,
        le=MAX_RECALL_TOKENS,
        description="host entries per layer and KV head a turn may recall (--kv-recall-tokens; 0: no host tier)",
    )
    host_tokens: int = Field(
        DEFAULT_HOST_TOKENS,
        ge=1,
        le=MAX_HOST_TOKENS,
        description="host tier capacity in columns, one evicted entry per layer and KV head each (--kv-host-tokens)",
    )
    recall_page: int = Field(
        DEFAULT_RECALL_PAGE,
        ge=1,
        le=MAX_RECALL_PAGE,
        description="host columns per recall page: an entry is ranked by the best entry of its page, so a "
        "recall brings an attended token's neighbours with it (--kv-recall-page)",
    )
    recall_summary: Literal["minmax", "mean", "off"] = Field(
        "minmax",
        description="how a recall finds the host entries it needs: score per-page key summaries, then fetch "
        "only the best pages' columns (minmax: per-channel key bounds; mean: the mean key), or off: score "
        "every host key (--kv-recall-summary)",
    )
    recall_fetch_pages: int = Field(
        DEFAULT_RECALL_FETCH_PAGES,
        ge=1,
        le=MAX_RECALL_FETCH_PAGES,
        description="pages a paged recall fetches at least, per layer and KV head, chosen by their summaries "
        "(it fetches 2R/page when that is more): the host keys a recall reads besides the summaries "
        "(--kv-recall-fetch-pages)",
    )
    recall_append: Literal["on", "off"] = Field(
        "on",
        description="after each turn's prefill, bring the turn's best host entries back into up to R fresh "
        "slots appended to the row, displacing nothing; the turn decodes over its budget plus them, and "
        "its next compression folds them back (--kv-recall-append)",
    )
    recall_every: int = Field(
        DEFAULT_RECALL_EVERY,
        ge=0,
        le=MAX_RECALL_EVERY,
        description="decode steps between recalls, each by its step's own query inside the step's forward; "
        "0: only in each turn's prefill (--kv-recall-every)",
    )
    recall_min_score: float = Field(
        DEFAULT_RECALL_MIN_SCORE,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="the least attention probability a query must give a host page's best entry for the page "
        "to come back (and it must beat the entry it displaces); 0: beating it is enough "
        "(--kv-recall-min-score)",
    )

    def to_env(self) -> str:
        return self.model_dump_json()


def parse_min_budget(text: str) -> tuple[int | None, float | None]:
    """`--kv-override-min-budget`: `256` (tokens), `25%` or `0.25` (ratio) or both, `256,25%`.

    Each part is a budget spelling (`parse_budget`), so the bare `1` is refused here too."""
    tokens: int | None = None
    ratio: float | None = None
    parts = [p for p in (x.strip() for x in str(text).split(",")) if p]
    if not parts or len(parts) > 2:
        raise ValueError(f"{short(text)}: give tokens (256), a ratio (25% or 0.25) or both (256,25%)")
    for part in parts:
        val = parse_budget(part)
        if isinstance(val, int):
            if tokens is not None:
                raise ValueError(f"{short(text)}: two token minimums")
            tokens = val
        else:
            if ratio is not None:
                raise ValueError(f"{short(text)}: two ratio minimums")
            ratio = val
    return tokens, ratio


def server_config() -> KvConfig:
    """The server-wide config in this process (from the launcher's environment)."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return KvConfig()
    return KvConfig.model_validate(json.loads(raw))


_SETTINGS: tuple[str | None, ServerSettings] | None = None


def server_settings() -> ServerSettings:
    """The operator's override rules in this process (from the launcher's environment; parsed once)."""
    global _SETTINGS
    raw = os.environ.get(SETTINGS_ENV_VAR)
    if _SETTINGS is None or _SETTINGS[0] != raw:
        _SETTINGS = (raw, ServerSettings.model_validate_json(raw) if raw else ServerSettings())
    return _SETTINGS[1]


def _check_operator_rules(
    raw: dict[str, Any], cfg: KvConfig, base: KvConfig, settings: ServerSettings
) -> None:
    """Raise ValueError naming the server flag that denies this override."""
    rules = settings.overrides
    if "policy" in raw and cfg.policy != base.policy and rules.policies is not None:
        if cfg.policy not in rules.policies:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.policy: {cfg.policy!r} is not allowed on this server "
                f"(--kv-override-policies {','.join(rules.policies)}; the server's own {base.policy!r} is too)"
            )
    same_budget = (type(cfg.budget), cfg.budget) == (type(base.budget), base.budget)  # 1 token != ratio 1.0
    if "budget" in raw and not same_budget and rules.has_min_budget:
        b = cfg.budget
        if isinstance(b, int):
            floor, kind = rules.min_budget_tokens, "tokens"
        else:
            floor, kind = rules.min_budget_ratio, "a ratio"
        if floor is None:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.budget: {b} is {kind}, but this server sets a minimum only for "
                f"the other kind (--kv-override-min-budget "
                f"{rules.min_budget_tokens if rules.min_budget_tokens is not None else rules.min_budget_ratio})"
            )
        if b < floor:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.budget: {b} is below this server's minimum {floor} "
                f"(--kv-override-min-budget)"
            )
    if cfg.active and settings.capture_window is not None:
        pol = cfg.build()
        if "attn" in pol.needs and pol.config.window > settings.capture_window:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.config.window: {pol.config.window} is above this server's "
                f"window-query buffer ({settings.capture_window}; --kv-capture-window)"
            )
    if cfg.recall_tokens and cfg.recall_tokens > settings.recall_tokens:
        raise ValueError(
            f"custom_params.{REQUEST_KEY}.recall_tokens: {cfg.recall_tokens} is above this server's "
            f"{settings.recall_tokens} (--kv-recall-tokens)"
        )
    if settings.quantization and cfg.active:
        pol = cfg.build()
        if "o_proj" in pol.needs:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.policy: {cfg.policy!r} reads o_proj's weights, which are "
                f"quantized on this server ({settings.quantization})"
            )


def request_override(
    custom_params: dict[str, Any] | None, base: KvConfig, settings: ServerSettings | None = None
) -> KvConfig | None:
    """The request's own config, or None when it gives none. Raises ValueError with a readable message.

    The operator's rules (`settings`, by default this server's) apply here, so the HTTP check (400) and
    the scheduler (which falls back to the server policy) judge an override the same way.
    """
    if not custom_params:
        return None
    if not isinstance(custom_params, dict):
        raise ValueError(f"custom_params must be an object, got {type(custom_params).__name__}")
    if REQUEST_KEY not in custom_params:
        return None
    settings = settings if settings is not None else server_settings()
    if not settings.overrides.enabled:
        raise ValueError(
            f"custom_params.{REQUEST_KEY}: per-request overrides are disabled on this server "
            "(--kv-disable-request-override)"
        )
    raw = custom_params[REQUEST_KEY]
    if not isinstance(raw, dict):
        raise ValueError(f"custom_params.{REQUEST_KEY} must be an object with policy/budget/config")
    unknown = set(raw) - {"policy", "budget", "config", "recall_tokens"}
    if unknown:
        raise ValueError(
            f"custom_params.{REQUEST_KEY}: unknown field(s) {sorted(short(k, 30) for k in unknown)}; "
            "valid: policy, budget, config, recall_tokens"
        )
    merged = {
        "policy": base.policy,
        "budget": spelling(base.budget),
        "config": base.config if "policy" not in raw else {},
    }
    merged.update(raw)
    try:
        cfg = KvConfig.model_validate(merged)
        cfg.build()
    except policies.PolicyConfigError as e:
        raise ValueError(f"custom_params.{REQUEST_KEY}: {e}") from None
    except Exception as e:  # pydantic ValidationError
        errs = getattr(e, "errors", None)
        if errs:
            err = errs()[0]
            loc = short(".".join(str(x) for x in err["loc"]), 60).strip("'\"")
            raise ValueError(f"custom_params.{REQUEST_KEY}.{loc}: {err['msg']}") from None
        raise ValueError(f"custom_params.{REQUEST_KEY}: {e}") from None
    _check_operator_rules(raw, cfg, base, settings)
    return cfg
