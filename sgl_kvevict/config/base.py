"""What every settings model shares: its trip through the environment and how its errors read.

SGLang drops unknown CLI fields and its `ServerArgs` is a frozen-schema msgspec struct, so the launcher
hands what it validated to SGLang's other processes in environment variables, one per model (`Published`).
A refusal is one line naming the field at fault (`first_error`), whether it ends a start (exit 2) or a
request (HTTP 400).
"""

from __future__ import annotations

import os
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError
from typing_extensions import Self

from sgl_kvevict.policies import short


class Published(BaseModel):
    """A model the launcher publishes in the environment variable `ENV` and every process reads back."""

    model_config = ConfigDict(extra="forbid")
    ENV: ClassVar[str]

    def to_env(self) -> str:
        return self.model_dump_json()

    def publish(self) -> None:
        """Hand this value to the processes the launcher starts next (they inherit the environment)."""
        os.environ[self.ENV] = self.to_env()

    @classmethod
    def from_env(cls, raw: str | None) -> Self:
        """The value published as `raw` (the variable's text); the defaults when nothing was."""
        return cls.model_validate_json(raw) if raw else cls()


def first_error(e: ValidationError, where: str = "") -> str:
    """The first error of `e` as one line: its dotted location under `where`, then pydantic's message.
    The location is cut short (a client's key could be a megabyte), the message keeps only its words."""
    err = e.errors()[0]
    loc = short(".".join(str(x) for x in err["loc"]), 60).strip("'\"")
    path = ".".join(p for p in (where, loc) if p)
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{path}: {msg}" if path else msg
