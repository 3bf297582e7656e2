"""`cubegate ...`: the command line. Each subcommand is a thin edge over a module.

Startup cost matters (tests and scripts run it hundreds of times): a command imports what
it needs inside its function, and the groups that live in other modules are imported only
when invoked (`cubegate --help` and `cubegate identity ...` load no vault, httpx or pydantic
they do not use; tests/cubegate/test_cli_startup.py pins it).
"""
from __future__ import annotations

import importlib
import json
import os
import sys

import click

from cubegate.cli_context import CliContext, cli_context

# name -> (module:attribute of the click group, its one-line help for `cubegate --help`);
# test_cli_startup checks each summary is the group's own.
LAZY_GROUPS = {
    "audit": ("egress.audit.cli:audit", "Query and follow the egress audit log."),
    "sandbox": ("cubegate.sandbox_cli:sandbox_cli",
                "Create, use and destroy sandboxes (needs the daemon with runtime.enabled)."),
    "template": ("cubegate.template_cli:template_cli",
                 "Build, list and remove sandbox templates (base, python, node, browser)."),
    "vault": ("vault.cli:vault_cli", "Credential vault: secrets, bindings, tokens."),
}


def load_group(name: str) -> click.Command:
    module, _, attr = LAZY_GROUPS[name][0].partition(":")
    return getattr(importlib.import_module(module), attr)


class _LazyTree(click.Group):
    """Imports a LAZY_GROUPS group when it is invoked; lists it by its summary."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(LAZY_GROUPS))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in LAZY_GROUPS and name not in self.commands:
            self.add_command(load_group(name), name)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        shown = [n for n in self.list_commands(ctx) if n not in self.commands or not self.commands[n].hidden]
        limit = formatter.width - 6 - max(map(len, shown))
        with formatter.section("Commands"):
            formatter.write_dl([(n, self._summary(n, limit)) for n in shown])

    def _summary(self, name: str, limit: int) -> str:
        cmd = self.commands.get(name) or click.Command(name, help=LAZY_GROUPS[name][1])
        return cmd.get_short_help_str(limit)


def _settings(ctx: click.Context):
    return cli_context(ctx).settings


@click.group(cls=_LazyTree)
@click.option("--config", "-c", envvar="CUBEGATE_CONFIG", type=click.Path(dir_okay=False),
              help="Settings YAML (env CUBEGATE_CONFIG); CUBEGATE_<SECTION>__<KEY> variables override it.")
@click.option("--state-dir", envvar="CUBEGATE_STATE_DIR", help="Override state_dir.")
@click.pass_context
def main(ctx: click.Context, config: str | None, state_dir: str | None) -> None:
    """cubegate: egress gateway and credential vault for AI-agent sandboxes."""
    ctx.obj = CliContext(config=config, state_dir=state_dir)


@main.command()
@click.option("--log-level", default="INFO", show_default=True)
@click.pass_context
def run(ctx: click.Context, log_level: str) -> None:
    """Run the gateway daemon in the foreground."""
    import asyncio
    import logging

    from cubegate.daemon import Daemon
    from egress.policy import PolicyError

    settings = _settings(ctx)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from egress import log_redact
    log_redact.install()   # the daemon's libraries (tornado, sqlite, ...) log no values either
    try:
        rc = asyncio.run(Daemon(settings).run())
    except PolicyError as e:
        raise click.ClickException(f"policy not loaded, refusing to start: {e}")
    sys.exit(rc)


@main.command()
@click.option("--state-dir", "state_dir", type=click.Path(file_okay=False),
              help="Where state goes (default: the global --state-dir, else the settings' state_dir).")
@click.pass_context
def init(ctx: click.Context, state_dir: str | None) -> None:
    """Create settings, state dir, interception CA and vault key (0600); never replaces what exists."""
    from pathlib import Path

    from cubegate.host_setup import init_host, next_steps
    from cubegate.settings import SettingsError

    cc = cli_context(ctx)
    state = Path(state_dir or cc.state_dir or (cc.settings.state_dir if cc.config else "/var/lib/cubegate"))
    settings_path = Path(cc.config) if cc.config else state / "settings.yaml"
    try:
        rep = init_host(state, settings_path)
    except (SettingsError, OSError) as e:
        raise click.ClickException(str(e))
    for what in rep.created:
        click.echo(f"created  {what}")
    for what in rep.kept:
        click.echo(f"kept     {what}")
    for what in rep.warnings:
        click.echo(f"warning: {what}", err=True)
    click.echo("")
    click.echo(next_steps(settings_path.absolute()), nl=False)


@main.group()
def ca() -> None:
    """The gateway's interception CA."""


@ca.command("env")
@click.pass_context
def ca_env(ctx: click.Context) -> None:
    """Print shell variables that make common toolchains trust the gateway's CA (eval "$(cubegate ca env)")."""
    from cubegate.host_setup import BUNDLE_NAME, ca_env_text, system_ca_bundle, write_bundle
    from egress.mitm_ca import ca_paths

    s = _settings(ctx)
    ca_cert = ca_paths(s.ca_dir)[1]
    if not ca_cert.exists():
        raise click.ClickException(f"no CA at {ca_cert}: run `cubegate init` (or start the daemon once)")
    system = system_ca_bundle()
    bundle = write_bundle(ca_cert, s.ca_dir / BUNDLE_NAME, system)
    click.echo(ca_env_text(bundle, ca_cert, system), nl=False)


# ------------------------------------------------------------------- policy
@main.group()
def policy() -> None:
    """Policies: files (check) and the daemon's policy API (apply, get, ls, rm, history, rollback, decide)."""


@policy.command("check")
@click.argument("path", type=click.Path(exists=True), required=False)
@click.pass_context
def policy_check(ctx: click.Context, path: str | None) -> None:
    """Validate a policy directory or file; print file:line errors."""
    from egress.policy import PolicyError, load_policy_dir, load_policy_files

    path = path or _settings(ctx).policy_dir
    try:
        compiled = load_policy_dir(path) if os.path.isdir(path) else load_policy_files([path])
    except PolicyError as e:
        click.echo(f"invalid: {e}", err=True)
        sys.exit(1)
    click.echo(f"ok: {len(compiled.sources)} file(s), digest {compiled.digest[:12]}")


def _parse_label(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise click.BadParameter(f"label must be key=value, got {text!r}")
    return k, v


# ----------------------------------------------------------------- identity
@main.group()
def identity() -> None:
    """Per-sandbox proxy credentials (explicit proxy mode)."""


@identity.command("add")
@click.argument("sandbox_id")
@click.option("--label", multiple=True, help="k=v (repeatable)")
@click.option("--replace", is_flag=True, help="Re-key an existing sandbox.")
@click.pass_context
def identity_add(ctx, sandbox_id, label, replace) -> None:
    """Create a sandbox identity; prints its token once (only a hash is stored)."""
    from egress.identity import IdentityError, IdentityStore

    store = IdentityStore(_settings(ctx).identity_db)
    try:
        token = store.add(sandbox_id, dict(_parse_label(l) for l in label), replace=replace)
    except IdentityError as e:
        raise click.ClickException(str(e))
    click.echo(token)


@identity.command("ls")
@click.pass_context
def identity_ls(ctx) -> None:
    from egress.identity import IdentityStore

    for ident in IdentityStore(_settings(ctx).identity_db).list():
        labels = ",".join(f"{k}={v}" for k, v in sorted(ident.labels.items()))
        click.echo(f"{ident.sandbox_id}\t{labels}")


@identity.command("rm")
@click.argument("sandbox_id")
@click.pass_context
def identity_rm(ctx, sandbox_id) -> None:
    from egress.identity import IdentityStore

    if not IdentityStore(_settings(ctx).identity_db).remove(sandbox_id):
        raise click.ClickException(f"no such sandbox identity: {sandbox_id}")


@identity.command("placeholders")
@click.argument("sandbox_id")
@click.pass_context
def identity_placeholders(ctx, sandbox_id) -> None:
    """Print the sandbox's placeholder env (CUBEGATE_SECRET_<ID>=cgph_...): harmless stand-ins for its secrets."""
    import vault as vaultlib
    from egress.credentials import DEFAULT_TENANT
    from egress.identity import IdentityStore
    from egress.policy import PolicyError, load_policy_dir

    s = _settings(ctx)
    ident = IdentityStore(s.identity_db).get(sandbox_id)
    if ident is None:
        raise click.ClickException(f"no such sandbox identity: {sandbox_id}")
    try:
        pol = load_policy_dir(s.policy_dir).policy_for(ident.sandbox_id, ident.labels)
    except PolicyError as e:
        raise click.ClickException(str(e))
    tenant = (pol.tenant if pol else None) or DEFAULT_TENANT
    try:
        v = cli_context(ctx).open_vault()
        try:
            for secret_id, ph in sorted(v.placeholders_for_sandbox(tenant, sandbox_id).items()):
                env = "CUBEGATE_SECRET_" + "".join(c if c.isalnum() else "_" for c in secret_id).upper()
                click.echo(f"{env}={ph}")
        finally:
            v.close()
    except vaultlib.VaultError as e:
        raise click.ClickException(str(e))


# ---------------------------------------------------------------------- net
@main.group()
def net() -> None:
    """The cubevs network switch."""


@net.command("status")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def net_status(ctx, as_json) -> None:
    """Backend in use (ebpf | nftables), steering, sandboxes and drop/allow counters.

    Reopening the switch re-applies missing map entries/attachments (idempotent).
    """
    from pathlib import Path

    from cubevs import Switch

    state_dir = Path(_settings(ctx).cubevs_state_dir)
    if not (state_dir / "cubevs.sqlite3").exists():
        raise click.ClickException(f"no cubevs switch in {state_dir} (no sandbox was ever attached)")
    sw = Switch.reopen(state_dir)
    try:
        st = sw.status()
        counters = sw.counters()
    finally:
        sw.close()
    if as_json:
        st["counters"] = [{"sandbox": k[0], "reason": k[1], "verdict": k[2], "packets": v[0], "bytes": v[1]}
                          for k, v in sorted(counters.items(), key=lambda kv: tuple(map(str, kv[0])))]
        click.echo(json.dumps(st, indent=1, default=str))
        return
    click.echo(f"backend: {st['backend']}" + (f" (fallback: {st['backend_fallback_reason']})"
                                                if st.get("backend_fallback_reason") else ""))
    click.echo(f"hub: {st['hub_netns'] or 'root namespace'}  gateway {st['gateway_ip']} ports {st['gateway_ports']}"
               f"  steering: {st['steering']}")
    for sb in st["sandboxes"]:
        click.echo(f"  {sb['sandbox_id']:<20} {sb['ip']:<15} {sb['host_ifname']:<14} "
                   f"{'attached' if sb['attached'] else 'NOT ATTACHED'}")
    for (sandbox, reason, verdict), (pk, by) in sorted(counters.items(), key=lambda kv: tuple(map(str, kv[0]))):
        click.echo(f"  {sandbox or '-':<20} {verdict:<5} {reason:<20} {pk} packets {by} bytes")


# ------------------------------------------------------ groups from other modules
def _mount_groups() -> None:
    """Groups from other modules (besides LAZY_GROUPS); each gets the CliContext as its ctx.obj."""
    from cubegate.policy_cli import access_cli, add_policy_commands
    add_policy_commands(policy)
    main.add_command(access_cli, "access")


_mount_groups()


@main.command()
@click.option("--keep", is_flag=True, help="Leave the lab and gateway running until Ctrl-C.")
def demo(keep: bool) -> None:
    """Start a lab network + the gateway with the example policy; show allowed, denied and audited requests."""
    from cubegate.demo import run_demo

    sys.exit(run_demo(keep=keep))


if __name__ == "__main__":
    main()
