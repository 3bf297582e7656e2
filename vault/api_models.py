"""Request and reply bodies of the admin API (vault/api.py), declared once.

The API validates requests with these models and its OpenAPI document is
generated from them. They check shape and types; the vault itself still
checks meaning (framing headers, overlaps, value rules) for every caller.
A secret value is a SecretStr: its repr is masked and no error quotes it.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, SecretStr

from httpkit import Body, Reply

from .core import MAX_VALUE_BYTES, MIN_VALUE_BYTES, PREVIOUS_VERSION_ACTIONS
from .names import _NAME

NAME_PATTERN = f"^{_NAME.pattern}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
SecretValue = Annotated[SecretStr, Field(description=f"{MIN_VALUE_BYTES}-{MAX_VALUE_BYTES} bytes, no CR/LF/NUL; "
                                                     "write-only: never returned")]


# -- requests ------------------------------------------------------------------
class NewSecret(Body):
    tenant: Name
    id: Name
    value: SecretValue
    description: str = ""


class Rotate(Body):
    value: SecretValue
    previous: Literal[PREVIOUS_VERSION_ACTIONS] = "disable"   # older active versions: kept, disabled or destroyed


class Unseal(Body):
    key_file: str | None = Field(None, description="path on the server, mode 0600")
    passphrase: SecretStr | None = None


class TenantQuery(Body):
    tenant: Name | None = None


class MatchIn(Body):
    hosts: list[str] = Field(min_length=1, description="exact names or '*.suffix'")
    ports: list[int] = [443]
    methods: list[str] | None = None
    path_prefixes: list[str] | None = None
    allow_plaintext: bool = False


class HeaderInject(Body):
    type: Literal["header"]
    name: str = "Authorization"
    format: str = Field("{secret}", description="exactly one {secret}")


class QueryInject(Body):
    type: Literal["query"]
    name: str


class BasicInject(Body):
    type: Literal["basic"]
    username: str


Inject = Annotated[Union[HeaderInject, QueryInject, BasicInject], Field(discriminator="type")]


class NewBinding(Body):
    id: Name
    tenant: Name
    secret_id: Name
    match: MatchIn
    inject: Inject
    placeholder: bool = False


# -- replies -----------------------------------------------------------------------
class Version(Reply):
    version: int
    state: Literal["active", "disabled", "destroyed"]
    fingerprint: str = Field(description="first 12 hex of HMAC-SHA256 (vault key, value)")
    created: float


class Secret(Reply):
    tenant: str
    id: str
    description: str
    created: float
    current_version: int | None = Field(description="highest active version: the one injected")
    versions: list[Version]


class SecretList(Reply):
    secrets: list[Secret]


class Match(Reply):
    hosts: list[str]
    ports: list[int]
    methods: list[str] | None
    path_prefixes: list[str] | None
    allow_plaintext: bool


class Binding(Reply):
    id: str
    tenant: str
    secret_id: str
    match: Match
    inject: dict[str, str]
    placeholder: bool


class BindingList(Reply):
    bindings: list[Binding]


class Status(Reply):
    sealed: bool
    path: str
    vault_id: str
    key_source: str | None
    generation: int
    secrets: int
    versions: int
    bindings: int
    tokens: int
