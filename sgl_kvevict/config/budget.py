"""How a budget is written: every accepted spelling, normalized to one value (`parse_budget`).

Its own module because the server flag (`--kv-budget`), a request (`custom_params.kvevict.budget`) and the
operator's minimum (`--kv-overrides` `min_budget`) all read budgets, and must read them alike.
"""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation
from typing import Any

from sgl_kvevict.policies import short

DEFAULT_BUDGET = 0.5
MAX_BUDGET_TOKENS = 1 << 24
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
