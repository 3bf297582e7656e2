"""`cubegate sandbox create|exec|ls|get|rm|init|cp|snapshot|clone|rollback|snapshots|snapshot-rm`:
a thin client of the daemon's sandbox API."""
from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import click

from cubegate.api_client import LocalApi, echo_rows
from cubegate.cli_context import cli_context


def _api(ctx: click.Context, timeout: float = 120.0) -> LocalApi:
    s = cli_context(ctx).settings
    return LocalApi("runtime API", s.runtime.api_port, s.runtime_dir / "api.token", timeout=timeout,
                    hint="is the daemon running with runtime.enabled, and are you root?")


def _pairs(items: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{what} must be NAME=VALUE, got {it!r}")
        out[k] = v
    return out


@click.group("sandbox")
def sandbox_cli() -> None:
    """Create, use and destroy sandboxes (needs the daemon with runtime.enabled)."""


@sandbox_cli.command("create")
@click.argument("sandbox_id")
@click.option("--tenant", required=True)
@click.option("--backend", default=None, help="namespace (default) or microvm")
@click.option("--template", default=None, help="root filesystem template (cubegate template ls)")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE (policy selection)")
@click.option("--env", "env", multiple=True, help="NAME=VALUE (never a real key: use --secret-env)")
@click.option("--secret-env", "secret_env", multiple=True, help="NAME=SECRET_ID: NAME gets the secret's placeholder")
@click.option("--file", "files", multiple=True, help="PATH_IN_WORKSPACE=LOCAL_FILE")
@click.option("--memory-mb", type=int)
@click.option("--cpus", type=float)
@click.option("--pids", type=int)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def create(ctx, sandbox_id, tenant, backend, template, labels, env, secret_env, files, memory_mb, cpus, pids,
           as_json):
    """Create a sandbox; returns when its agent answered and its network is attached."""
    doc = {"id": sandbox_id, "tenant": tenant, "labels": _pairs(labels, "--label"), "env": _pairs(env, "--env"),
           "secret_env": _pairs(secret_env, "--secret-env"),
           "files": {p: base64.b64encode(Path(f).read_bytes()).decode() for p, f in _pairs(files, "--file").items()},
           "limits": {k: v for k, v in (("memory_mb", memory_mb), ("cpus", cpus), ("pids", pids)) if v is not None}}
    if backend:
        doc["backend"] = backend
    if template:
        doc["template"] = template
    out = _api(ctx).call("POST", "/sandboxes", json=doc)
    click.echo(json.dumps(out, indent=2) if as_json else
               f"{out['id']} {out['state']} {out['backend']} ip {out['ip']} started in {out['start_ms']} ms")


@sandbox_cli.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", type=float, default=30.0, show_default=True)
@click.option("--env", "env", multiple=True, help="NAME=VALUE for this command only")
@click.option("--stdin", "use_stdin", is_flag=True, help="send this command's stdin")
@click.pass_context
def exec_(ctx, sandbox_id, argv, timeout, env, use_stdin):
    """Run ARGV in the sandbox; prints its stdout/stderr and exits with its exit code."""
    doc = {"argv": list(argv), "timeout": timeout, "env": _pairs(env, "--env")}
    if use_stdin:
        doc["stdin_b64"] = base64.b64encode(sys.stdin.buffer.read()).decode()
    out = _api(ctx, timeout + 30).call("POST", f"/sandboxes/{sandbox_id}/exec", json=doc)
    sys.stdout.buffer.write(base64.b64decode(out["stdout_b64"]))
    sys.stderr.buffer.write(base64.b64decode(out["stderr_b64"]))
    if out["timed_out"]:
        click.echo(f"cubegate: timed out after {timeout} s", err=True)
    code = out["exit_code"]
    sys.exit(code if 0 <= code < 256 else 128 + (-code if code < 0 else 1))


@sandbox_cli.command("ls")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def ls(ctx, as_json):
    """List sandboxes."""
    echo_rows(_api(ctx).call("GET", "/sandboxes")["sandboxes"],
              lambda r: f"{r['id']:<24} {r['tenant']:<14} {r['backend']:<10} {r['state']:<8} {r['ip'] or '-':<15} "
                        f"{r['limits']['memory_mb']:>6} {r['start_ms']}",
              as_json=as_json,
              header=f"{'ID':<24} {'TENANT':<14} {'BACKEND':<10} {'STATE':<8} {'IP':<15} {'MEM_MB':>6} START_MS")


@sandbox_cli.command("get")
@click.argument("sandbox_id")
@click.pass_context
def get(ctx, sandbox_id):
    """One sandbox as JSON, with its measured usage."""
    click.echo(json.dumps(_api(ctx).call("GET", f"/sandboxes/{sandbox_id}"), indent=2))


@sandbox_cli.command("rm")
@click.argument("sandbox_ids", nargs=-1, required=True)
@click.pass_context
def rm(ctx, sandbox_ids):
    """Destroy sandboxes (processes, cgroups, network, identity)."""
    _delete_each(ctx, "sandboxes", sandbox_ids, "destroyed")


@sandbox_cli.command("init")
@click.argument("sandbox_id")
@click.option("--env", "env", multiple=True)
@click.option("--secret-env", "secret_env", multiple=True)
@click.pass_context
def init(ctx, sandbox_id, env, secret_env):
    """Re-apply runtime state (current placeholders + env); idempotent."""
    out = _api(ctx).call("POST", f"/sandboxes/{sandbox_id}/init",
                         json={"env": _pairs(env, "--env"), "secret_env": _pairs(secret_env, "--secret-env")})
    click.echo(f"{out['id']}: env {', '.join(out['env']) or '-'}")


@sandbox_cli.command("cp")
@click.argument("src")
@click.argument("dst")
@click.pass_context
def cp(ctx, src, dst):
    """Copy a file in or out: `cp ./local ID:/workspace/f` or `cp ID:/workspace/f ./local`."""
    def remote(spec: str):
        sid, sep, path = spec.partition(":")
        return (sid, path) if sep and path.startswith("/") and "/" not in sid else None
    api = _api(ctx)
    if remote(dst) and not remote(src):
        sid, path = remote(dst)
        api.call("PUT", f"/sandboxes/{sid}/files", params={"path": path}, content=Path(src).read_bytes())
    elif remote(src) and not remote(dst):
        sid, path = remote(src)
        Path(dst).write_bytes(api.request("GET", f"/sandboxes/{sid}/files", params={"path": path}).content)
    else:
        raise click.BadParameter("exactly one side must be SANDBOX_ID:/absolute/path")
    click.echo(f"{src} -> {dst}")


@sandbox_cli.command("snapshot")
@click.argument("sandbox_id")
@click.option("--name", "snapshot_id", default=None, help="snapshot id (default: SANDBOX_ID-<8 hex>)")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def snapshot(ctx, sandbox_id, snapshot_id, as_json):
    """Snapshot a sandbox's files (its writable layer); its processes are not kept."""
    doc = {"id": snapshot_id} if snapshot_id else {}
    out = _api(ctx).call("POST", f"/sandboxes/{sandbox_id}/snapshot", json=doc)
    click.echo(json.dumps(out, indent=2) if as_json else
               f"{out['id']} of {out['sandbox']} ({out['template']}, {out['size_bytes']} bytes)")


@sandbox_cli.command("clone")
@click.argument("snapshot_id")
@click.argument("sandbox_ids", nargs=-1, required=True)
@click.option("--label", "labels", multiple=True, help="KEY=VALUE (policy selection of the clones)")
@click.option("--env", "env", multiple=True, help="NAME=VALUE")
@click.option("--secret-env", "secret_env", multiple=True, help="NAME=SECRET_ID: each clone gets its own placeholder")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def clone(ctx, snapshot_id, sandbox_ids, labels, env, secret_env, as_json):
    """Start one sandbox per SANDBOX_ID from a snapshot (all or none); each its own identity,
    address, placeholders and policy."""
    doc = {"ids": list(sandbox_ids), "labels": _pairs(labels, "--label"), "env": _pairs(env, "--env"),
           "secret_env": _pairs(secret_env, "--secret-env")}
    echo_rows(_api(ctx).call("POST", f"/snapshots/{snapshot_id}/clone", json=doc)["sandboxes"],
              lambda sb: f"{sb['id']} {sb['state']} ip {sb['ip']} started in {sb['start_ms']} ms", as_json=as_json)


@sandbox_cli.command("rollback")
@click.argument("sandbox_id")
@click.argument("snapshot_id")
@click.pass_context
def rollback(ctx, sandbox_id, snapshot_id):
    """Stop the sandbox, restore its files from a snapshot, start it again (new processes)."""
    out = _api(ctx).call("POST", f"/sandboxes/{sandbox_id}/rollback", json={"snapshot": snapshot_id})
    click.echo(f"{out['id']} {out['state']}: files of snapshot {snapshot_id}")


@sandbox_cli.command("snapshots")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def snapshots(ctx, as_json):
    """List snapshots."""
    echo_rows(_api(ctx).call("GET", "/snapshots")["snapshots"],
              lambda r: f"{r['id']:<40} {r['sandbox']:<24} {r['tenant']:<14} {r['template'] or '-':<10} "
                        f"{r['size_bytes']:>10}",
              as_json=as_json, header=f"{'ID':<40} {'SANDBOX':<24} {'TENANT':<14} {'TEMPLATE':<10} {'BYTES':>10}")


@sandbox_cli.command("snapshot-rm")
@click.argument("snapshot_ids", nargs=-1, required=True)
@click.pass_context
def snapshot_rm(ctx, snapshot_ids):
    """Remove snapshots."""
    _delete_each(ctx, "snapshots", snapshot_ids, "removed")


def _delete_each(ctx: click.Context, collection: str, ids: tuple[str, ...], done: str) -> None:
    """DELETE /<collection>/<id> for each id in turn (the first refusal stops the rest)."""
    api = _api(ctx)
    for item in ids:
        api.call("DELETE", f"/{collection}/{item}")
        click.echo(f"{item} {done}")
