"""Base classes for request and reply models.

Body: what a client sends; unknown fields are refused (a typo is an error,
not silently ignored) and numbers must be finite. Reply: what we answer.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, hide_input_in_errors=True)


class Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")
