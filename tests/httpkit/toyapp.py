"""A small app built with httpkit the way an API of ours is: used by the kit's tests."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, SecretStr

import httpkit
from httpkit import ApiError, Body, JsonHandler, PathParam, Reply, operation

TOKEN = "toy-token-0123456789"


class Key(Body):
    name: Annotated[str, Field(pattern="^[a-z]{1,8}$")]
    value: SecretStr
    tags: list[str] = []


class Hit(Body):
    hosts: list[str] = Field(min_length=1)
    ports: list[int] = [443]


class A(Body):
    type: Literal["a"]
    x: int


class B(Body):
    type: Literal["b"]
    y: str


class Thing(Body):
    match: Hit
    kind: Annotated[Union[A, B], Field(discriminator="type")]
    timeout: float = 1.0


class Saved(Reply):
    name: str


class Boom(Exception):
    pass


class _Base(JsonHandler):
    realm = "toy"
    error_map = [(KeyError, 404, "not_found")]

    def initialize(self, store: dict, records: list) -> None:
        super().initialize(records.append)
        self.store = store

    def authenticate(self, token: str):
        return "tester" if token == TOKEN else None

    def audit_record(self) -> dict:
        return {"action": self.action, "actor": self.actor, "status": self.get_status(), "reason": self.reason,
                **self.audit}


class Keys(_Base):
    action = "keys"

    @operation("Store a key", body=Key, status=201, reply=Saved)
    def post(self, body: Key) -> None:
        self.store[body.name] = body.value.get_secret_value()
        self.audit["name"] = body.name
        self.reply(201, Saved(name=body.name))


class OneKey(_Base):
    action = "key"

    @operation("Has a key", reply=Saved, errors=(404,))
    def get(self, name: str) -> None:
        self.store[name]   # KeyError -> 404 via the error map
        self.reply(200, {"name": name})


class Things(_Base):
    action = "things"

    @operation("Validate a thing", body=Thing)
    def post(self, body: Thing) -> None:
        self.reply(200, body.model_dump(mode="json"))


class Crash(_Base):
    action = "crash"

    @operation("Fails inside")
    def post(self) -> None:
        secret = self.store.get("k", "nothing")
        raise Boom(f"database said: {secret}")

    @operation("Refused by the handler")
    def get(self) -> None:
        raise ApiError(409, "conflict", "busy")


ROUTES = [("/keys", Keys), ("/keys/{name}", OneKey), ("/things", Things), ("/crash", Crash),
          ("/openapi.json", httpkit.openapi_handler(_Base, public=True))]


def make(store: dict, records: list):
    return httpkit.make_app(ROUTES, base=_Base, kwargs={"store": store, "records": records},
                            params={"name": PathParam("[a-z]{1,8}", {"type": "string"})}, title="toy",
                            log_name="toy.api")
