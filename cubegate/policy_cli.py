"""`cubegate policy apply|get|ls|rm|history|rollback|decide|suggest` and `cubegate access ls|approve|deny`:
thin clients of the daemon's policy API (cubegate/policy_api.py), with the local admin token."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from cubegate.api_client import LocalApi, echo_rows
from cubegate.cli_context import cli_context


def _api(ctx: click.Context) -> LocalApi:
    s = cli_context(ctx).settings
    return LocalApi("policy API", s.policy_api.port, s.admin_token_file, timeout=30.0,
                    hint="is the daemon running, and are you root?")


def _echo(doc) -> None:
    click.echo(json.dumps(doc, indent=1, sort_keys=False))


def add_policy_commands(policy: click.Group) -> None:
    @policy.command("apply")
    @click.option("-f", "--file", "path", type=click.File("r"), required=True, help="Policy YAML or JSON ('-': stdin).")
    @click.option("--name", help="Policy name (default: the document's name:, else the file's stem).")
    @click.option("--dry-run", is_flag=True, help="Validate only.")
    @click.pass_context
    def apply(ctx, path, name, dry_run) -> None:
        """Create or replace a policy through the daemon (versioned, audited, in force at once)."""
        text = path.read()
        if name is None:
            import yaml

            try:
                doc = yaml.safe_load(text)
            except yaml.YAMLError:
                doc = None
            name = doc.get("name") if isinstance(doc, dict) and isinstance(doc.get("name"), str) else None
            name = name or (Path(path.name).stem if path.name not in ("<stdin>", "-") else None)
            if not name:
                raise click.UsageError("give --name (the document has no name:)")
        api = _api(ctx)
        if dry_run:
            _echo(api.call("POST", f"/policies/{name}/validate", content=text.encode()))
            return
        v = api.call("PUT", f"/policies/{name}", content=text.encode())
        click.echo(f"policy {name}: version {v['version']} ({v['action']})")

    @policy.command("get")
    @click.argument("name")
    @click.option("--json", "as_json", is_flag=True)
    @click.pass_context
    def get(ctx, name, as_json) -> None:
        """Show a policy in force (YAML), with its source and version."""
        doc = _api(ctx).call("GET", f"/policies/{name}")
        if as_json:
            _echo(doc)
            return
        src = doc["source"] + (f" version {doc['version']} by {doc['actor']}" if doc.get("version") else
                               f" {doc.get('file')}")
        if doc.get("overrides_file"):
            src += f" (replaces {doc['overrides_file']})"
        click.echo(f"# {name}: {src}")
        import yaml
        click.echo(yaml.safe_dump(doc["policy"], sort_keys=False), nl=False)

    @policy.command("ls")
    @click.pass_context
    def ls(ctx) -> None:
        """Every policy in force: name, source, version, mode, rules."""
        doc = _api(ctx).call("GET", "/policies")
        for p in doc["policies"]:
            where = f"api v{p['version']}" if p["source"] == "api" else f"file {p['file']}"
            click.echo(f"{p['name']:<30} {where:<40} {p['mode']:<8} {p['rules']} rule(s)"
                       + ("  (default)" if p["default_policy"] else ""))

    @policy.command("rm")
    @click.argument("name")
    @click.pass_context
    def rm(ctx, name) -> None:
        """Delete an API policy (a file policy of the same name is in force again)."""
        v = _api(ctx).call("DELETE", f"/policies/{name}")
        click.echo(f"policy {name}: deleted (version {v['version']})")

    @policy.command("history")
    @click.argument("name")
    @click.option("--json", "as_json", is_flag=True)
    @click.pass_context
    def history(ctx, name, as_json) -> None:
        """Every version of an API policy, newest first."""
        doc = _api(ctx).call("GET", f"/policies/{name}/history")
        echo_rows(doc["versions"], lambda v: f"v{v['version']:<4} {v['action']:<9} {v['actor']:<16} {v['ts']:.3f}"
                  + (f"  {v['note']}" if v.get("note") else ""), as_json=as_json, document=doc, indent=1)

    @policy.command("rollback")
    @click.argument("name")
    @click.argument("version", type=int)
    @click.pass_context
    def rollback(ctx, name, version) -> None:
        """Make an earlier version current again (stored as a new version)."""
        v = _api(ctx).call("POST", f"/policies/{name}/rollback", json={"version": version})
        click.echo(f"policy {name}: version {v['version']} (rollback to {version})")

    @policy.command("decide")
    @click.option("--sandbox", required=True)
    @click.option("--label", multiple=True, help="k=v")
    @click.option("--host", required=True)
    @click.option("--port", type=int, default=443, show_default=True)
    @click.option("--scheme")
    @click.option("--method")
    @click.option("--path", "req_path")
    @click.option("--files", "files_only", is_flag=True, help="Decide with the policy files alone, no daemon.")
    @click.pass_context
    def decide(ctx, sandbox, label, host, port, scheme, method, req_path, files_only) -> None:
        """Explain what the policy in force decides for one request (no traffic sent)."""
        labels = dict(_pair(x) for x in label)
        if files_only:
            import dataclasses

            from egress.policy import PolicyError, RequestInfo, load_policy_dir
            try:
                compiled = load_policy_dir(cli_context(ctx).settings.policy_dir)
            except PolicyError as e:
                raise click.ClickException(str(e))
            _echo(dataclasses.asdict(compiled.decide(RequestInfo(
                sandbox_id=sandbox, labels=labels, host=host, port=port, scheme=scheme, method=method,
                path=req_path))))
            return
        body = {"sandbox": sandbox, "labels": labels, "host": host, "port": port, "scheme": scheme,
                "method": method, "path": req_path}
        _echo(_api(ctx).call("POST", "/decide", json={k: v for k, v in body.items() if v is not None}))

    @policy.command("suggest")
    @click.option("--sandbox")
    @click.option("--label", help="K=V: sandboxes with this label")
    @click.option("--since", default="1h", show_default=True, help="e.g. 30m, 1h, 2d")
    @click.option("--name", help="Name of the suggested policy.")
    @click.option("--min-siblings", type=int, default=4, show_default=True,
                  help="A wildcard only where at least this many sibling names were seen.")
    @click.pass_context
    def suggest(ctx, sandbox, label, since, name, min_siblings) -> None:
        """Learn mode: the smallest allow policy for what report mode recorded as would-deny (YAML)."""
        import yaml

        from cubegate.suggest import suggest_policy, would_deny_records
        if bool(sandbox) == bool(label):
            raise click.UsageError("give exactly one of --sandbox or --label")
        sel = _pair(label) if label else None
        records = would_deny_records(cli_context(ctx).settings, sandbox=sandbox, label=sel, since=since)
        doc = suggest_policy(records, sandbox=sandbox, label=sel, name=name, min_siblings=min_siblings)
        click.echo(yaml.safe_dump(doc, sort_keys=False), nl=False)


def _pair(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise click.BadParameter(f"expected K=V, got {text!r}")
    return k, v


@click.group("access")
def access_cli() -> None:
    """Access requests sandboxes filed at cubegate.internal."""


@access_cli.command("ls")
@click.option("--state", type=click.Choice(["pending", "approved", "denied"]))
@click.option("--sandbox")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def access_ls(ctx, state, sandbox, as_json) -> None:
    params = {k: v for k, v in (("state", state), ("sandbox", sandbox)) if v}
    doc = _api(ctx).call("GET", "/access-requests", params=params)
    echo_rows(doc["requests"], lambda r: f"{r['id']}  {r['state']:<8} {r['sandbox']:<20} {r['host']}:{r['port']}  "
              f"{r['reason'][:60]!r}", as_json=as_json, document=doc, indent=1)


@access_cli.command("approve")
@click.argument("request_id")
@click.option("--scope", type=click.Choice(["sandbox", "labels", "tenant"]), default="sandbox", show_default=True)
@click.option("--expires", "expires", help="e.g. 30m, 8h, 7d (default: until revoked)")
@click.option("--note")
@click.pass_context
def access_approve(ctx, request_id, scope, expires, note) -> None:
    from cubegate.suggest import parse_duration
    body = {"scope": scope, "note": note}
    if expires:
        body["expires_in_seconds"] = parse_duration(expires)
    r = _api(ctx).call("POST", f"/access-requests/{request_id}/approve",
                       json={k: v for k, v in body.items() if v is not None})
    click.echo(f"approved {r['id']}: {r['host']}:{r['port']} for {scope} (grant {r['grant']})")


@access_cli.command("deny")
@click.argument("request_id")
@click.option("--note")
@click.pass_context
def access_deny(ctx, request_id, note) -> None:
    r = _api(ctx).call("POST", f"/access-requests/{request_id}/deny", json={"note": note} if note else {})
    click.echo(f"denied {r['id']}")
