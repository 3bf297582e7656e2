"""`cubegate template build|ls|rm`: root filesystem templates for sandboxes, built
locally (root, apt: mmdebstrap) into <state_dir>/.cache/templates."""
from __future__ import annotations

import json

import click

from cubegate.cli_context import cli_context


def _store(ctx: click.Context):
    from sandbox_runtime.templates import TemplateStore
    return TemplateStore(cli_context(ctx).settings.template_cache_dir)


@click.group("template")
def template_cli() -> None:
    """Build, list and remove sandbox templates (base, python, node, browser)."""


@template_cli.command("build")
@click.argument("names", nargs=-1, required=True)
@click.option("--force", is_flag=True, help="rebuild even if the same key is cached")
@click.pass_context
def build(ctx, names, force):
    """Build templates from their package lists (cached by content address)."""
    from sandbox_runtime.templates import TemplateError
    from sandbox_runtime.templates.build import BuildError
    from sandbox_runtime.templates.progress import Progress
    store = _store(ctx)
    for name in names:
        try:
            t = store.build(name, force=force, progress=Progress(name))
        except (TemplateError, BuildError) as e:
            raise click.ClickException(str(e))
        click.echo(f"{name} {t.key[:12]} {t.rootfs}")


@template_cli.command("ls")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def ls(ctx, as_json):
    """Defined and built templates: key, size, packages, whether current and in use."""
    rows = _store(ctx).list()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'NAME':10} {'KEY':12} {'STATE':9} {'SIZE':>8} {'PKGS':>5} {'BUILD':>7}")
    for r in rows:
        state = ("stale" if not r["current"] else "built") if r["built"] else "not built"
        if r.get("in_use"):
            state += "*"
        size = f"{(r.get('size_bytes') or 0) / 2**20:.0f}M" if r["built"] else "-"
        build_s = f"{r['build_seconds']:.0f}s" if r.get("build_seconds") else "-"
        click.echo(f"{r['name'] or '?':10} {r['key'][:12]:12} {state:9} {size:>8} "
                   f"{r.get('packages', '-'):>5} {build_s:>7}")


@template_cli.command("rm")
@click.argument("names", nargs=-1, required=True)
@click.pass_context
def rm(ctx, names):
    """Remove every build of the named templates (refused while a sandbox uses one)."""
    from sandbox_runtime.templates import TemplateError
    store = _store(ctx)
    for name in names:
        try:
            keys = store.remove(name)
        except TemplateError as e:
            raise click.ClickException(str(e))
        click.echo(f"{name}: removed {len(keys)} build(s)")
