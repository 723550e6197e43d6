"""The launcher's `--kv-*` flags and `sgl.Engine`'s keywords, made from the models' fields (`FLAGS`).

A field with a `flag` in its `json_schema_extra` is one: named, parsed, bounded and described by the field,
so `--help`, the docs' tables (checked by tests/test_settings_docs.py) and the checks never drift apart.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from sgl_kvevict import policies
from sgl_kvevict.config.base import first_error
from sgl_kvevict.config.budget import parse_budget
from sgl_kvevict.config.policy import KvConfig
from sgl_kvevict.config.server import ServerSettings
from sgl_kvevict.policies import short
from sgl_kvevict.policies.base import PolicyConfig


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


# pydantic's error types for a number outside a field's bounds (NaN, which no bound admits, among them)
_BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})


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

    @functools.cached_property
    def validator(self) -> TypeAdapter[Any]:
        """The field's own type and bounds (`Field(ge=..., le=...)`), to check a number flag's value with."""
        return TypeAdapter(Annotated[(self.info.annotation, *self.info.metadata)])

    def is_off(self, value: Any) -> bool:
        """`off`: the one text a JSON-object flag takes besides JSON (`--kv-overrides off`)."""
        return self.nested is not None and isinstance(value, str) and value.strip() == "off"

    def wanted(self, got: Any) -> str:
        """Why a value of the wrong type is refused: the type and the range it must have."""
        kind = "a number" if self.is_float else "an integer"
        return f"must be {kind} in {self.range}, got {short(got)}"

    def parse(self, text: str) -> Any:
        """A command-line value -> the field's value. Raises ValueError naming the range or choices."""
        if self.extra.get("parse") == "budget":
            return parse_budget(text)
        if self.choices is not None:
            if text not in self.choices:
                raise ValueError(f"invalid choice: {short(text)}; valid choices: {', '.join(self.choices)}")
            return text
        if self.nested is not None or self.info.annotation == dict[str, Any]:
            return self.coerce(text.strip() if self.is_off(text) else _json_object(text))
        try:
            num = (float if self.is_float else int)(text.strip())
        except ValueError:
            raise ValueError(self.wanted(text)) from None
        return self.coerce(num)

    def coerce(self, value: Any) -> Any:
        """A Python value (an `sgl.Engine` keyword, or a parsed flag) -> the field's value, checked by the
        field itself (a number strictly: no bool, no 2.0 for 2); the error names the range or choices."""
        if isinstance(value, str) and not self.is_off(value):
            return self.parse(value)
        if self.extra.get("parse") == "budget":
            return parse_budget(value)
        if self.choices is not None:
            return self.parse(repr(value))
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
                raise ValueError(first_error(e) + (f" (valid: {rng})" if rng else "")) from None
        if self.info.annotation == dict[str, Any]:
            if not isinstance(value, dict):
                raise ValueError(f"must be a JSON object, got {type(value).__name__}")
            return value
        try:
            return self.validator.validate_python(value, strict=True)
        except ValidationError as e:
            if e.errors()[0]["type"] in _BOUND_ERRORS:
                raise ValueError(f"{short(value)} out of range: must be in {self.range}") from None
            raise ValueError(self.wanted(value)) from None


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
