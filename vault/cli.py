"""`vault` command group (mounted by the lead as `cubegate vault`).

Works on the SQLite file directly (local administration); the HTTP API is for
remote use. Secret values come from stdin or --from-file, never from argv.

Settings: --db / CUBEGATE_VAULT_DB, --key-file / CUBEGATE_VAULT_KEY_FILE (default
<db>.key). The master key comes from vault.keysource.unseal_from (CUBEGATE_VAULT_KEY,
else the key file, else for a passphrase vault CUBEGATE_VAULT_PASSPHRASE or a prompt).
A parent command may pass its context object in ctx.obj (see VaultCliHost) for the
defaults and the host policy check.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import click

from typing import Callable, Protocol

from . import crypto
from .bindings import doc_from_options
from .core import Vault
from .errors import VaultError
from .keysource import PASSPHRASE_ENV, unseal_from


class VaultCliHost(Protocol):
    """What a parent command's context object offers this group (all may be None)."""
    vault_db: str | None
    vault_key_file: str | None
    host_policy_check: Callable | None


class _State:
    def __init__(self, db: str | None, key_file: str | None, host_policy_check):
        self.db, self._key_file, self.host_policy_check = db, key_file, host_policy_check

    @property
    def key_file(self) -> str:
        return self._key_file or f"{self.db}.key"

    def open(self, unseal: bool = False) -> Vault:
        vault = Vault.open(self.db, host_policy_check=self.host_policy_check)
        if unseal:
            try:
                interactive = sys.stdin.isatty()
                unseal_from(vault, self.key_file, prompt=(lambda: _passphrase(confirm=False)) if interactive else None)
            except VaultError:
                vault.close()
                raise
        return vault


def _passphrase(confirm: bool) -> str:
    env = os.environ.get(PASSPHRASE_ENV)
    if env:
        return env
    return click.prompt("Vault passphrase", hide_input=True, confirmation_prompt=confirm, err=True)


def _run(fn):
    """Turn vault errors into a one-line message and exit code 1."""
    try:
        return fn()
    except (VaultError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:   # e.g. the vault's directory does not exist
        raise click.ClickException(f"{e.filename or 'vault'}: {e.strerror}") from None


def _read_value(from_file: str | None) -> bytes:
    if from_file:
        with open(from_file, "rb") as f:
            data = f.read(64 * 1024 + 2)
    elif sys.stdin.isatty():
        data = click.prompt("Secret value", hide_input=True, confirmation_prompt=True, err=True).encode()
    else:
        data = sys.stdin.buffer.read(64 * 1024 + 2)
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    return data


def _parse_ttl(text: str) -> float | None:
    if text.lower() in ("none", "never", "0"):
        return None
    m = re.fullmatch(r"(\d+)([smhd]?)", text.strip().lower())
    if not m:
        raise click.BadParameter("use e.g. 3600, 90m, 12h, 30d or 'never'")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


@click.group("vault")
@click.option("--db", envvar="CUBEGATE_VAULT_DB", help="vault file (env CUBEGATE_VAULT_DB)")
@click.option("--key-file", envvar="CUBEGATE_VAULT_KEY_FILE", help="master key file (default <db>.key)")
@click.pass_context
def vault_cli(ctx: click.Context, db: str | None, key_file: str | None) -> None:
    """Credential vault: secrets, bindings, tokens."""
    host = ctx.obj
    db = db or getattr(host, "vault_db", None)
    if not db:
        raise click.UsageError("no vault file: give --db or set CUBEGATE_VAULT_DB")
    ctx.obj = _State(db, key_file or getattr(host, "vault_key_file", None), getattr(host, "host_policy_check", None))


pass_state = click.make_pass_decorator(_State)


@vault_cli.command()
@click.option("--passphrase", "use_passphrase", is_flag=True, help="derive the master key from a passphrase (scrypt)")
@click.option("--from-env", is_flag=True, help="use the master key in CUBEGATE_VAULT_KEY (base64)")
@pass_state
def init(st: _State, use_passphrase: bool, from_env: bool) -> None:
    """Create the vault file and (by default) a new 0600 key file."""
    def go():
        if use_passphrase and from_env:
            raise click.UsageError("--passphrase and --from-env exclude each other")
        if use_passphrase:
            Vault.init(st.db, passphrase=_passphrase(confirm=True)).close()
            click.echo(f"initialised {st.db} (passphrase)")
        elif from_env:
            key = crypto.key_from_env()
            if key is None:
                raise click.UsageError("CUBEGATE_VAULT_KEY is not set")
            Vault.init(st.db, key, key_source="env").close()
            click.echo(f"initialised {st.db} (key from CUBEGATE_VAULT_KEY)")
        else:
            if os.path.exists(st.db):
                raise click.ClickException(f"{st.db} exists already")
            key = crypto.create_key_file(st.key_file)
            Vault.init(st.db, key).close()
            click.echo(f"initialised {st.db}; master key in {st.key_file} (mode 0600) - back it up")
    _run(go)


@vault_cli.command("unseal-check")
@click.option("--deep", is_flag=True, help="also decrypt every version and check fingerprints")
@pass_state
def unseal_check(st: _State, deep: bool) -> None:
    """Check that the master key opens the vault."""
    def go():
        v = st.open(unseal=True)
        problems = v.verify() if deep else []
        v.close()
        for p in problems:
            click.echo(f"problem: {p}", err=True)
        if problems:
            raise click.ClickException(f"{len(problems)} version(s) failed verification")
        click.echo("ok: master key opens the vault" + (" and every version decrypts" if deep else ""))
    _run(go)


@vault_cli.command()
@click.option("--json", "as_json", is_flag=True)
@pass_state
def status(st: _State, as_json: bool) -> None:
    """Counts and state of the vault file."""
    def go():
        v = st.open()
        s = v.status()
        v.close()
        s["sealed"] = "n/a (this process holds no key)"
        click.echo(json.dumps(s, indent=2) if as_json else "\n".join(f"{k}: {val}" for k, val in s.items()))
    _run(go)


# -- secrets -----------------------------------------------------------------
@vault_cli.group()
def secret() -> None:
    """Secrets (values are read from stdin or --from-file, never from argv)."""


@secret.command("put")
@click.argument("tenant")
@click.argument("secret_id")
@click.option("--from-file", type=click.Path(exists=True, dir_okay=False))
@click.option("--description", default="")
@pass_state
def secret_put(st: _State, tenant: str, secret_id: str, from_file: str | None, description: str) -> None:
    """Create a secret (version 1)."""
    def go():
        value = _read_value(from_file)
        v = st.open(unseal=True)
        info = v.put_secret(tenant, secret_id, value, description=description)
        v.close()
        click.echo(f"stored {tenant}/{secret_id} v{info.current_version} fingerprint "
                   f"{info.versions[-1].fingerprint}")
    _run(go)


@secret.command("rotate")
@click.argument("tenant")
@click.argument("secret_id")
@click.option("--from-file", type=click.Path(exists=True, dir_okay=False))
@click.option("--previous", type=click.Choice(["keep", "disable", "destroy"]), default="disable",
              show_default=True, help="what happens to the older active versions")
@pass_state
def secret_rotate(st: _State, tenant: str, secret_id: str, from_file: str | None, previous: str) -> None:
    """Add a new version; it is injected from the next request on."""
    def go():
        value = _read_value(from_file)
        v = st.open(unseal=True)
        info = v.rotate(tenant, secret_id, value, previous=previous)
        v.close()
        click.echo(f"rotated {tenant}/{secret_id} to v{info.current_version} fingerprint "
                   f"{info.versions[-1].fingerprint}")
    _run(go)


@secret.command("ls")
@click.option("--tenant")
@click.option("--json", "as_json", is_flag=True)
@pass_state
def secret_ls(st: _State, tenant: str | None, as_json: bool) -> None:
    """List secrets and their versions (never values)."""
    def go():
        v = st.open()
        infos = v.list_secrets(tenant)
        v.close()
        if as_json:
            click.echo(json.dumps([i.to_dict() for i in infos], indent=2))
            return
        for i in infos:
            versions = " ".join(f"v{x.version}:{x.state}:{x.fingerprint}" for x in i.versions)
            click.echo(f"{i.tenant}/{i.id}\tcurrent=v{i.current_version}\t{versions}\t{i.description}")
    _run(go)


@secret.command("rm")
@click.argument("tenant")
@click.argument("secret_id")
@click.confirmation_option(prompt="Delete the secret and all its versions?")
@pass_state
def secret_rm(st: _State, tenant: str, secret_id: str) -> None:
    """Delete a secret (refused while a binding uses it)."""
    def go():
        v = st.open()
        v.delete_secret(tenant, secret_id)
        v.close()
        click.echo(f"deleted {tenant}/{secret_id}")
    _run(go)


# -- versions ----------------------------------------------------------------
@vault_cli.group()
def version() -> None:
    """Secret versions."""


def _version_cmd(name: str, method: str, help_text: str, confirm: bool = False):
    @click.argument("tenant")
    @click.argument("secret_id")
    @click.argument("number", type=int)
    @pass_state
    def cmd(st: _State, tenant: str, secret_id: str, number: int) -> None:
        def go():
            v = st.open()
            info = getattr(v, method)(tenant, secret_id, number)
            v.close()
            click.echo(f"{tenant}/{secret_id} v{number}: {name}d; current=v{info.current_version}")
        _run(go)
    cmd.__doc__ = help_text
    if confirm:
        cmd = click.confirmation_option(prompt="Destroy irreversibly?")(cmd)
    return version.command(name)(cmd)


_version_cmd("disable", "disable_version", "Stop using a version (it stays decryptable).")
_version_cmd("enable", "enable_version", "Re-enable a disabled version.")
_version_cmd("destroy", "destroy_version", "Wipe a version's ciphertext (irreversible).", confirm=True)


# -- bindings ----------------------------------------------------------------
@vault_cli.group()
def binding() -> None:
    """Bindings: which secret goes into which requests."""


@binding.command("add")
@click.option("--json", "json_file", type=click.File("r"), help="binding document ('-' for stdin)")
@click.option("--id", "binding_id")
@click.option("--tenant")
@click.option("--secret", "secret_id")
@click.option("--host", "hosts", multiple=True)
@click.option("--port", "ports", multiple=True, type=int)
@click.option("--method", "methods", multiple=True)
@click.option("--path-prefix", "path_prefixes", multiple=True)
@click.option("--allow-plaintext", is_flag=True)
@click.option("--header", help="inject into this header")
@click.option("--format", "fmt", default="Bearer {secret}", show_default=True, help="header value format")
@click.option("--query", help="inject as this query parameter")
@click.option("--basic-user", help="inject HTTP basic auth with this username")
@click.option("--placeholder", is_flag=True, help="the sandbox gets a placeholder value")
@pass_state
def binding_add(st: _State, json_file, binding_id, tenant, secret_id, hosts, ports, methods, path_prefixes,
                allow_plaintext, header, fmt, query, basic_user, placeholder) -> None:
    """Add a binding (from flags or --json)."""
    def go():
        if json_file is not None:
            doc = json.load(json_file)
        else:
            try:
                doc = doc_from_options(binding_id=binding_id, tenant=tenant, secret_id=secret_id, hosts=hosts,
                                       ports=ports, methods=methods, path_prefixes=path_prefixes,
                                       allow_plaintext=allow_plaintext, header=header, fmt=fmt, query=query,
                                       basic_user=basic_user, placeholder=placeholder)
            except ValueError:
                raise click.UsageError("give exactly one of --header, --query, --basic-user") from None
        v = st.open()
        b = v.add_binding(doc)
        v.close()
        click.echo(f"added binding {b.id}")
    _run(go)


@binding.command("ls")
@click.option("--tenant")
@pass_state
def binding_ls(st: _State, tenant: str | None) -> None:
    """List bindings as JSON lines."""
    def go():
        v = st.open()
        for b in v.list_bindings(tenant):
            click.echo(json.dumps(b.to_dict()))
        v.close()
    _run(go)


@binding.command("rm")
@click.argument("binding_id")
@pass_state
def binding_rm(st: _State, binding_id: str) -> None:
    """Remove a binding."""
    def go():
        v = st.open()
        v.remove_binding(binding_id)
        v.close()
        click.echo(f"removed binding {binding_id}")
    _run(go)


# -- tokens ----------------------------------------------------------------------
@vault_cli.group()
def token() -> None:
    """Admin API bearer tokens."""


@token.command("create")
@click.option("--scope", type=click.Choice(["admin", "read"]), required=True)
@click.option("--ttl", default="30d", show_default=True, help="e.g. 3600, 90m, 12h, 30d, never")
@click.option("--description", default="")
@pass_state
def token_create(st: _State, scope: str, ttl: str, description: str) -> None:
    """Create a token; it is printed once and only its hash is stored."""
    def go():
        v = st.open()
        info, tok = v.tokens.create(scope, _parse_ttl(ttl), description)
        v.close()
        exp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info.expires)) if info.expires else "never"
        click.echo(f"token id {info.id}, scope {scope}, expires {exp}", err=True)
        click.echo(tok)
    _run(go)


@token.command("ls")
@pass_state
def token_ls(st: _State) -> None:
    """List tokens (ids and scopes only)."""
    def go():
        v = st.open()
        for t in v.tokens.list():
            exp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t.expires)) if t.expires else "never"
            click.echo(f"{t.id}\t{t.scope}\texpires={exp}{'(expired)' if t.expired() else ''}\t{t.description}")
        v.close()
    _run(go)


@token.command("revoke")
@click.argument("token_id")
@pass_state
def token_revoke(st: _State, token_id: str) -> None:
    """Revoke a token by id."""
    def go():
        v = st.open()
        v.tokens.revoke(token_id)
        v.close()
        click.echo(f"revoked {token_id}")
    _run(go)


main = vault_cli
