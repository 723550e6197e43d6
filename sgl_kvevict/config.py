"""User-facing configuration: the server-wide KV policy and the per-request override, both validated.

Server-wide settings come from `--kv-policy`, `--kv-budget`, `--kv-scope`, `--kv-policy-config`. They travel from the
launcher to the scheduler process in the environment variable `KVEVICT_SERVER_CONFIG` (SGLang drops unknown
CLI fields and its `ServerArgs` is a frozen-schema msgspec struct).
A request may override them with `custom_params={"kvevict": {"policy": ..., "budget": ..., "config": {...}}}`.
What a request may override is the operator's call (`--kv-overrides`) plus what the server cannot run (CriticalKV on a
quantized `o_proj`): `ServerSettings`, carried in `KVEVICT_SERVER_SETTINGS`. It is a separate model because
`KvConfig` is also what a request sends.

The launcher's flags and `sgl.Engine`'s keywords are made from the models' fields (`FLAGS`): a field with
a `flag` in its `json_schema_extra` is one, named, parsed, bounded and described by the field.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from sgl_kvevict import policies
from sgl_kvevict.policies import short
from sgl_kvevict.policies.base import PolicyConfig

ENV_VAR = "KVEVICT_SERVER_CONFIG"
SETTINGS_ENV_VAR = "KVEVICT_SERVER_SETTINGS"
REQUEST_KEY = "kvevict"
DEFAULT_BUDGET = 0.5


MAX_BUDGET_TOKENS = 1 << 24
MAX_STEP_TOKENS = 1 << 24
MAX_RECALL_TOKENS = 4096  # bound on --kv-recall-tokens and a request's recall_tokens (per layer and head)
MAX_HOST_TOKENS = 1 << 21  # bound on --kv-host-tokens (host columns)
MIN_HOST_GIB, MAX_HOST_GIB = 0.001, 4096.0  # bounds on --kv-host-gib (per rank; then checked in columns too)
DEFAULT_HOST_TOKENS = 16384
MAX_RECALL_PAGE = 256  # bound on the recall page (host columns per page)
MAX_RECALL_EVERY = 4096  # bound on recall every (decode steps)
DEFAULT_RECALL_PAGE = 8
# Every decode step recalls by its own query: on the recall suite's client-composed history it answered
# 10-11 of 12 where recall at each turn's start only answered 4-7 (docs/benchmarks.md, "Recall suite").
DEFAULT_RECALL_EVERY = 1
# A decode step recalls only in the (layer, KV head) pairs whose induction score reaches this
# (`cache/host_tier/retrieval_heads.py`): SmolLM2-135M has 10 of 90, and recalling in them alone answered within
# one of recalling in every head, per policy, on the long recall scenario, for 1.08x decode, not 1.36x (measured).
DEFAULT_RECALL_HEAD_SCORE = 0.1
MAX_CAPTURE = 4096  # bound on the capture buffer's window and slots (the buffer is their product)
DEFAULT_CAPTURE_SLOTS = 128  # capture slots when --max-running-requests is not given
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

    policy: str = Field(
        "none",
        description="KV compression policy for each request's own suffix",
        json_schema_extra={"flag": "--kv-policy", "choices": "policies"},
    )
    budget: int | float = Field(
        DEFAULT_BUDGET,
        description="tokens kept per KV head beyond sinks+recent window (e.g. 256), or a percent of the "
        'suffix (e.g. 50%; 0.5 works too); the bare 1 is refused as ambiguous: write 100% or {"tokens": 1}',
        json_schema_extra={"flag": "--kv-budget", "parse": "budget"},
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="policy config as JSON, e.g. '{\"lag\": 64}'",
        json_schema_extra={"flag": "--kv-policy-config"},
    )
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
    """What the operator lets a request override (`custom_params.kvevict`): the `--kv-overrides` setting.

    The server's own policy and budget are always allowed. A budget is judged only against a minimum of
    the same kind: tokens against `min_budget_tokens`, a ratio against `min_budget_ratio`. A request
    budget of a kind the operator gave no minimum for is denied when the operator gave a minimum of the
    other kind (a ratio cannot be compared with a token count before the request's length is known).
    `min_budget` writes both at once: `"256"`, `"25%"` or `"256,25%"` (see `parse_min_budget`).
    """

    model_config = ConfigDict(extra="forbid")
    # keys `_spellings` turns into fields (`--help` lists them beside the fields)
    SPELLINGS: ClassVar[dict[str, str]] = {
        "min_budget": "both minimums in one budget spelling: 256, 25% or 256,25% (sets min_budget_tokens "
        "and min_budget_ratio)"
    }

    enabled: bool = Field(True, description="false: deny every custom_params.kvevict (HTTP 400)")
    policies: list[str] | None = Field(
        None, description="policies an override may name, a list or comma-separated; null: all"
    )
    min_budget_tokens: int | None = Field(
        None, ge=1, le=MAX_BUDGET_TOKENS, description="smallest token budget an override may ask for"
    )
    min_budget_ratio: float | None = Field(
        None, gt=0.0, le=1.0, description="smallest ratio budget an override may ask for"
    )
    max_window: int | None = Field(
        None,
        ge=1,
        le=MAX_CAPTURE,
        description="the most window queries a request may score with (default: the server policy's "
        "window, at least 32); a larger per-request window is HTTP 400",
    )

    @model_validator(mode="before")
    @classmethod
    def _spellings(cls, data: Any) -> Any:
        """`"off"` is `{"enabled": false}`; `min_budget` is the two minimums in one budget spelling."""
        if isinstance(data, str) and data.strip() == "off":
            return {"enabled": False}
        if isinstance(data, dict) and "min_budget" in data:
            data = dict(data)
            text = data.pop("min_budget")
            if "min_budget_tokens" in data or "min_budget_ratio" in data:
                raise ValueError("give min_budget, or min_budget_tokens / min_budget_ratio, not both")
            if isinstance(text, bool) or not isinstance(text, (str, int, float)):
                raise ValueError(
                    f"min_budget: give tokens (256), a ratio (25%) or both (256,25%), not {short(text)}"
                )
            try:
                data["min_budget_tokens"], data["min_budget_ratio"] = parse_min_budget(str(text))
            except ValueError as e:
                raise ValueError(f"min_budget: {e}") from None
        return data

    @field_validator("policies", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

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
                f"unknown KV policy {short(bad[0])}; valid choices: {', '.join(policies.available())}"
            )
        return sorted(set(v))

    @model_validator(mode="after")
    def _useful(self) -> OverridePolicy:
        if not self.enabled:
            given = [
                k
                for k in ("policies", "min_budget_tokens", "min_budget_ratio", "max_window")
                if getattr(self, k) is not None
            ]
            if given:
                raise ValueError(
                    f"{given[0]} has no effect when overrides are off (enabled: false): drop one"
                )
        return self

    @property
    def has_min_budget(self) -> bool:
        return self.min_budget_tokens is not None or self.min_budget_ratio is not None


class RecallTuning(BaseModel):
    """The host tier's tuning knobs: the `--kv-recall-config` setting (each has a measured default)."""

    model_config = ConfigDict(extra="forbid")

    page: int = Field(
        DEFAULT_RECALL_PAGE,
        ge=1,
        le=MAX_RECALL_PAGE,
        description="host columns per recall page: an entry is ranked by the best entry of its page, so a "
        "recall brings an attended token's neighbours with it",
    )
    every: int = Field(
        DEFAULT_RECALL_EVERY,
        ge=1,
        le=MAX_RECALL_EVERY,
        description="decode steps between recalls, each by its step's own query inside the step's forward "
        "(eager decode; where a CUDA graph replays the step, after its compression instead)",
    )
    head_score: float = Field(
        DEFAULT_RECALL_HEAD_SCORE,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="a decode step recalls only in the model's retrieval heads: the (layer, KV head) pairs "
        "whose induction score (the attention a repeated token gives what followed its first occurrence, "
        "measured once per model) is at least this; 0: every head",
    )


class ServerSettings(BaseModel):
    """Server-wide settings known to every process (HTTP and scheduler); the fields with a `flag` are the
    launcher's flags (see `FLAGS`), the others are derived at start."""

    model_config = ConfigDict(extra="forbid")

    overrides: OverridePolicy = Field(
        default_factory=OverridePolicy,
        description="what a request may override: off, or a JSON object with the keys below",
        json_schema_extra={"flag": "--kv-overrides"},
    )
    quantization: str | None = Field(
        None, description="how the weights are quantized (which flag), if at all; derived"
    )
    step_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_STEP_TOKENS,
        description="cap on the region tokens compressed in one scheduler step (e.g. 4096): once a step has "
        "compressed that many, other requests' compressions wait for the next steps, so several large "
        "compressions do not stall the batch in the same step (one always runs; default: no cap)",
        json_schema_extra={"flag": "--kv-compress-step-tokens"},
    )

    capture_window: int | None = Field(
        None,
        ge=1,
        le=MAX_CAPTURE,
        description="the most window queries a request may score with (the server policy's window, at least "
        "32, or the operator's overrides max_window); None: no request of this server captures queries",
    )
    capture_slots: int = Field(
        DEFAULT_CAPTURE_SLOTS,
        ge=1,
        le=MAX_CAPTURE,
        description="requests that can capture window queries at once (--max-running-requests, else 128)",
    )

    recall_tokens: int = Field(
        0,
        ge=0,
        le=MAX_RECALL_TOKENS,
        description="host tier: evicted entries go to host memory, and each turn recalls up to this many per "
        "layer and KV head into its kept history (0: off)",
        json_schema_extra={"flag": "--kv-recall-tokens"},
    )
    host_tokens: int = Field(
        DEFAULT_HOST_TOKENS,
        ge=1,
        le=MAX_HOST_TOKENS,
        description="host tier capacity in columns (one evicted entry per layer and KV head each; needs "
        "--kv-recall-tokens); branches are dropped least-recently-used beyond it",
        json_schema_extra={"flag": "--kv-host-tokens"},
    )
    host_gib: float | None = Field(
        None,
        ge=MIN_HOST_GIB,
        le=MAX_HOST_GIB,
        description="host tier capacity in GiB per rank instead of --kv-host-tokens (not with it): "
        "turned into columns at start from the model's layers x KV heads x head dim x dtype bytes x 2 (K and "
        "V), which must come to [1, 2097152] columns (needs --kv-recall-tokens; default: none, "
        "--kv-host-tokens sizes the tier)",
        json_schema_extra={"flag": "--kv-host-gib"},
    )
    recall: RecallTuning = Field(
        default_factory=RecallTuning,
        description="recall's tuning knobs as a JSON object with the keys below (needs --kv-recall-tokens)",
        json_schema_extra={"flag": "--kv-recall-config"},
    )

    def to_env(self) -> str:
        return self.model_dump_json()


def _bounds(info: FieldInfo) -> tuple[Any, Any]:
    lo = hi = None
    for m in info.metadata:
        lo = getattr(m, "ge", None) if getattr(m, "ge", None) is not None else lo
        hi = getattr(m, "le", None) if getattr(m, "le", None) is not None else hi
    return lo, hi


def interval(info: FieldInfo) -> str:
    """A number field's bounds as `--help` and the docs write them: `[lo, hi]`, with `(` or `)` for a
    strict bound; '' when it has not both."""
    lo = hi = None
    left, right = "[", "]"
    for m in info.metadata:
        for attr, side in (("ge", "["), ("gt", "(")):
            if getattr(m, attr, None) is not None:
                lo, left = getattr(m, attr), side
        for attr, side in (("le", "]"), ("lt", ")")):
            if getattr(m, attr, None) is not None:
                hi, right = getattr(m, attr), side
    return f"{left}{lo}, {hi}{right}" if lo is not None and hi is not None else ""


def _json_object(text: str) -> dict[str, Any]:
    try:
        val = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at char {e.pos}): {short(text)}") from None
    except RecursionError:
        raise ValueError(f"JSON nested too deeply: {short(text)}") from None
    if not isinstance(val, dict):
        raise ValueError(f"must be a JSON object, got {type(val).__name__}")
    return val


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{short(loc, 40).strip(chr(39))}: {msg}" if loc else msg


@dataclass(frozen=True)
class Flag:
    """One launcher flag (and `sgl.Engine` keyword), made from one model field: its name, parser, bounds,
    choices, default and help all come from the field."""

    name: str
    model: type[BaseModel]
    field: str

    @property
    def info(self) -> FieldInfo:
        return self.model.model_fields[self.field]

    @property
    def dest(self) -> str:
        """The argparse destination and the `sgl.Engine` keyword: `--kv-recall-tokens` -> `kv_recall_tokens`."""
        return self.name[2:].replace("-", "_")

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.info.json_schema_extra or {})

    @property
    def nested(self) -> type[BaseModel] | None:
        """The model a JSON-object flag is validated into (`--kv-overrides`, `--kv-recall-config`)."""
        ann = self.info.annotation
        return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None

    @property
    def choices(self) -> tuple[str, ...] | None:
        if self.extra.get("choices") == "policies":
            return tuple(policies.available())
        args = get_args(self.info.annotation)
        if get_origin(self.info.annotation) is Literal:
            return tuple(args)
        return None

    @property
    def default(self) -> Any:
        if self.info.default_factory is not None:
            val = self.info.default_factory()
            return val.model_dump() if isinstance(val, BaseModel) else val
        return self.info.default

    @property
    def is_float(self) -> bool:
        """A number flag that takes fractions (`--kv-host-gib`), not an integer one."""
        return float in (self.info.annotation, *get_args(self.info.annotation))

    @property
    def range(self) -> str:
        """`[lo, hi]` (`(`, `)` for strict bounds), the choices, or '' (a JSON object, a budget)."""
        if self.choices is not None:
            return " | ".join(self.choices)
        return interval(self.info)

    @property
    def help(self) -> str:
        text = self.info.description or ""
        if self.nested is not None:
            keys = []
            for key, sub in self.nested.model_fields.items():
                rng = Flag(key, self.nested, key).range
                dflt = sub.default if sub.default_factory is None else None
                # one default per key: a description that states its own (what null means) keeps it
                said = (
                    []
                    if dflt is None and "default" in (sub.description or "")
                    else [f"default {json.dumps(dflt)}"]
                )
                keys.append(f"{key}: {sub.description} ({'; '.join(said + ([rng] if rng else []))})")
            for key, what in getattr(self.nested, "SPELLINGS", {}).items():  # keys that write other keys
                keys.append(f"{key}: {what} (default null)")
            return f"{text}: " + "; ".join(keys)
        bits = [text]
        if self.default is not None:
            bits.append(f"default {json.dumps(self.default) if self.default == {} else self.default}")
        if self.range and self.choices is None:
            bits.append(f"in {self.range}")
        return "; ".join(b for b in bits if b)

    def parse(self, text: str) -> Any:
        """A command-line value -> the field's value. Raises ValueError naming the range or choices."""
        nested, kind = self.nested, self.extra.get("parse")
        if kind == "budget":
            return parse_budget(text)
        if self.choices is not None:
            if text not in self.choices:
                raise ValueError(f"invalid choice: {short(text)}; valid choices: {', '.join(self.choices)}")
            return text
        if nested is not None or self.info.annotation == dict[str, Any]:
            obj: Any = text.strip() if nested is not None and text.strip() == "off" else _json_object(text)
            return self.coerce(obj)
        lo, hi = _bounds(self.info)
        if self.is_float:
            try:
                num = float(text.strip())
            except ValueError:
                raise ValueError(f"must be a number in [{lo}, {hi}], got {short(text)}") from None
            return self.coerce(num)
        try:
            val = int(text.strip())
        except ValueError:
            raise ValueError(f"must be an integer in [{lo}, {hi}], got {short(text)}") from None
        return self.coerce(val)

    def coerce(self, value: Any) -> Any:
        """A Python value (an `sgl.Engine` keyword, or a parsed flag) -> the field's value, checked."""
        if isinstance(value, str) and not (self.nested is not None and value.strip() == "off"):
            return self.parse(value)
        if self.extra.get("parse") == "budget":
            return parse_budget(value)
        nested = self.nested
        if nested is not None:
            if isinstance(value, nested):
                return value
            if not isinstance(value, (dict, str)):
                raise ValueError(f"must be a JSON object, got {type(value).__name__}")
            try:
                return nested.model_validate(value)
            except ValidationError as e:
                key = e.errors()[0]["loc"][:1]
                sub = key[0] if key and key[0] in nested.model_fields else None
                rng = Flag(str(sub), nested, str(sub)).range if sub else ""
                raise ValueError(_first_error(e) + (f" (valid: {rng})" if rng else "")) from None
        if self.info.annotation == dict[str, Any]:
            if not isinstance(value, dict):
                raise ValueError(f"must be a JSON object, got {type(value).__name__}")
            return value
        if self.choices is not None:
            return self.parse(str(value)) if not isinstance(value, bool) else self.parse(repr(value))
        lo, hi = _bounds(self.info)
        if self.is_float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"must be a number in [{lo}, {hi}], got {short(value)}")
            if not lo <= value <= hi:
                raise ValueError(f"{short(value)} out of range: must be in [{lo}, {hi}]")
            return float(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer in [{lo}, {hi}], got {short(value)}")
        if not lo <= value <= hi:
            raise ValueError(f"{short(value)} out of range: must be in [{lo}, {hi}]")
        return value


def _flags() -> tuple[Flag, ...]:
    own = [
        Flag(info.json_schema_extra["flag"], model, name)  # type: ignore[index]
        for model in (KvConfig, ServerSettings)
        for name, info in model.model_fields.items()
        if isinstance(info.json_schema_extra, dict) and "flag" in info.json_schema_extra
    ]
    # the scope is a field of every policy's config; the flag writes it into --kv-policy-config
    scope = Flag("--kv-scope", PolicyConfig, "scope")
    return (*own[:3], scope, *own[3:])


FLAGS = _flags()
FLAG = {f.name: f for f in FLAGS}


def parse_min_budget(text: str) -> tuple[int | None, float | None]:
    """`--kv-overrides` `min_budget`: `256` (tokens), `25%` or `0.25` (ratio) or both, `256,25%`.

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


def server_settings() -> ServerSettings:
    """The operator's override rules in this process (from the launcher's environment; parsed once per
    value). A server's cache keeps the ones it started with (`cache.context.KvEvictContext.settings`)."""
    return _settings_from(os.environ.get(SETTINGS_ENV_VAR))


@functools.lru_cache(maxsize=8)
def _settings_from(raw: str | None) -> ServerSettings:
    return ServerSettings.model_validate_json(raw) if raw else ServerSettings()


def _check_operator_rules(
    raw: dict[str, Any], cfg: KvConfig, base: KvConfig, settings: ServerSettings
) -> None:
    """Raise ValueError naming the server flag that denies this override."""
    rules = settings.overrides
    if "policy" in raw and cfg.policy != base.policy and rules.policies is not None:
        if cfg.policy not in rules.policies:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.policy: {cfg.policy!r} is not allowed on this server "
                f"(--kv-overrides policies {','.join(rules.policies)}; the server's own {base.policy!r} is too)"
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
                f"the other kind (--kv-overrides min_budget "
                f"{rules.min_budget_tokens if rules.min_budget_tokens is not None else rules.min_budget_ratio})"
            )
        if b < floor:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.budget: {b} is below this server's minimum {floor} "
                f"(--kv-overrides min_budget)"
            )
    if cfg.active and settings.capture_window is not None:
        pol = cfg.build()
        if "attn" in pol.needs and pol.config.window > settings.capture_window:
            raise ValueError(
                f"custom_params.{REQUEST_KEY}.config.window: {pol.config.window} is above this server's "
                f"window-query buffer ({settings.capture_window}; --kv-overrides max_window)"
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
            "(--kv-overrides off)"
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
