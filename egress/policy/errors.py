"""Errors raised while loading or compiling policy files."""

from __future__ import annotations

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
