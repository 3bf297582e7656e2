"""Errors raised while loading or compiling policy files."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ErrorItem:
    """One problem in one place: rendered as ``FILE:LINE: field.path: message``."""

    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


def json_pointer(field: str) -> str:
    """``rules[0].match.hosts[1]`` -> ``/rules/0/match/hosts/1`` (RFC 6901); "" for the document."""
    if not field or field == "(top level)":
        return ""
    parts = re.findall(r"[^.\[\]]+", field)
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


class PolicyError(Exception):
    """A policy file (or set of files) is invalid.

    ``str(err)`` is one ``FILE:LINE: field.path: message`` line per problem;
    ``err.items`` keeps them structured for callers that want them.
    """

    def __init__(self, items: list[ErrorItem] | ErrorItem):
        if isinstance(items, ErrorItem):
            items = [items]
        self.items: tuple[ErrorItem, ...] = tuple(items)
        super().__init__("\n".join(str(i) for i in self.items))

    def pointers(self) -> list[dict]:
        """For an API body: every problem as {pointer, message} (JSON pointer instead of file:line)."""
        return [{"pointer": json_pointer(i.field), "message": i.message} for i in self.items]
