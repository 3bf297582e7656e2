"""`python -m sandbox_runtime.microvm build [--dest DIR]` builds the guest assets;
`... probe` times a boot per accelerator; `... template --memory-mb N` pre-builds a snapshot."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from sandbox_runtime.backend import Limits

from . import assets


class Display:
    """Steps as numbered lines; byte/member progress on one rewritten line (a tty) or a
    few plain lines (a log)."""

    STEPS = 5

    def __init__(self, out=sys.stderr):
        self.out, self.tty, self.n, self.t0 = out, out.isatty(), 0, time.monotonic()
        self._last = 0.0

    def __call__(self, kind: str, **kw) -> None:
        if kind == "step":
            self._end_line()
            self.n += 1
            self.out.write(f"[{self.n}/{self.STEPS}] {kw['name']}\n")
        elif kind in ("bytes", "members"):
            now = time.monotonic()
            done, total = kw["done"], kw.get("total")
            final = total is not None and done >= total
            if not final and now - self._last < (0.1 if self.tty else 2.0):
                return
            self._last = now
            if kind == "bytes":
                pct = f" {100 * done / total:5.1f}%" if total else ""
                text = f"      {done / 1e6:6.1f} / {total / 1e6:.1f} MB{pct}" if total else f"      {done / 1e6:.1f} MB"
            else:
                text = f"      {done} files scanned"
            self.out.write(("\r" + text) if self.tty else text + "\n")
            self._dirty = self.tty
        elif kind in ("info", "done"):
            self._end_line()
            self.out.write(f"      {kw['text']}" + (f" ({time.monotonic() - self.t0:.1f} s)" if kind == "done" else "")
                           + "\n")
        self.out.flush()

    def _end_line(self) -> None:
        if getattr(self, "_dirty", False):
            self.out.write("\n")
            self._dirty = False


@click.group()
def main() -> None:
    """cubegate microVM guest assets."""


@main.command()
@click.option("--dest", type=click.Path(path_type=Path), default=assets.DEFAULT_ASSETS_DIR, show_default=True)
@click.option("--agent", type=click.Path(path_type=Path), default=assets.DEFAULT_AGENT, show_default=True)
@click.option("--force", is_flag=True, help="rebuild even when up to date")
def build(dest: Path, agent: Path, force: bool) -> None:
    """Download Debian's cloud kernel and build the initramfs (busybox + agent)."""
    try:
        assets.build(dest, agent=agent, progress=Display(), force=force)
    except (RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.option("--dest", type=click.Path(path_type=Path), default=assets.DEFAULT_ASSETS_DIR, show_default=True)
def probe(dest: Path) -> None:
    """Time a guest boot under TCG and KVM; print (and cache) the choice."""
    from .backend import MicrovmBackend
    click.echo(MicrovmBackend(dest / "state", dest).accel())


@main.command()
@click.option("--dest", type=click.Path(path_type=Path), default=assets.DEFAULT_ASSETS_DIR, show_default=True)
@click.option("--memory-mb", type=int, default=256, show_default=True)
@click.option("--cpus", type=float, default=1.0, show_default=True)
def template(dest: Path, memory_mb: int, cpus: float) -> None:
    """Build (or show) the template snapshot for a memory size."""
    from .backend import MicrovmBackend
    t0 = time.monotonic()
    t = MicrovmBackend(dest / "state", dest).template_for(Limits(memory_mb=memory_mb, cpus=cpus))
    click.echo(f"{t.snapshot} ({time.monotonic() - t0:.1f} s)")


if __name__ == "__main__":
    main()
