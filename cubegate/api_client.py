"""What the CLIs that talk to the daemon's loopback APIs share (policy_cli, sandbox_cli):
the local token file, one request with the API's errors as one ClickException, and listings."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    import httpx

MAX_ERROR_TEXT = 500


class LocalApi:
    """`what` names the API in messages; `hint` says why its token file may be unreadable."""

    def __init__(self, what: str, port: int, token_file: Path, *, timeout: float, hint: str):
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            raise click.ClickException(f"cannot read the {what} token {token_file}: {e.strerror} ({hint})") from None
        self.what = what
        self.base = f"http://127.0.0.1:{port}/v1"
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeout = timeout

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        """The response (status < 400); else a ClickException with the API's message and each
        problem's JSON pointer. Environment proxies are never used: the API is on loopback."""
        import httpx   # here, not at the top: `cubegate --help` and local commands never load it

        try:
            r = httpx.request(method, self.base + path, headers=self.headers, timeout=self.timeout,
                              trust_env=False, **kw)
        except httpx.HTTPError as e:
            raise click.ClickException(f"{self.what} at {self.base}: {e}") from None
        if r.status_code >= 400:
            raise click.ClickException(_error_text(r))
        return r

    def call(self, method: str, path: str, **kw):
        """The response's JSON document (None for an empty body)."""
        r = self.request(method, path, **kw)
        return r.json() if r.content else None


def _error_text(r: httpx.Response) -> str:
    try:
        doc = r.json()
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        return f"{r.status_code}: {r.text[:MAX_ERROR_TEXT]}"
    lines = [f"{r.status_code}: {doc.get('message', r.text[:MAX_ERROR_TEXT])}"]
    for err in doc.get("errors") or []:
        lines.append(f"  {err.get('pointer') or '/'}: {err.get('message')}")
    return "\n".join(lines)


def echo_rows(rows: list[dict], line: Callable[[dict], str], *, as_json: bool = False, header: str | None = None,
              document=None, indent: int = 2) -> None:
    """A listing: with --json the API's `document` (default: the rows) as JSON; else the header
    (if any) and one line per row."""
    if as_json:
        click.echo(json.dumps(rows if document is None else document, indent=indent))
        return
    if header:
        click.echo(header)
    for row in rows:
        click.echo(line(row))
