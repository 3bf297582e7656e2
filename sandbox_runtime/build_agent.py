"""Build the static exec agent: `python -m sandbox_runtime.build_agent`.

gcc -O2 -static → sandbox_runtime/agent/cubegate-agent (git-ignored). Rebuilt only
when agent.c is newer than the binary (or with --force).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

AGENT_DIR = Path(__file__).resolve().parent / "agent"
SOURCE = AGENT_DIR / "agent.c"
BINARY = AGENT_DIR / "cubegate-agent"


class BuildError(RuntimeError):
    pass


def build(force: bool = False, output: Path = BINARY) -> Path:
    if not force and output.exists() and output.stat().st_mtime >= SOURCE.stat().st_mtime:
        return output
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BuildError("no C compiler (apt: gcc, libc6-dev)")
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")   # concurrent builds do not clash
    cmd = [cc, "-O2", "-static", "-Wall", "-Wextra", "-o", str(tmp), str(SOURCE)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise BuildError(f"agent build failed:\n{r.stderr[-4000:]}")
    tmp.chmod(0o755)
    tmp.replace(output)   # atomic: a running sandbox keeps its old inode
    return output


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        path = build(force="--force" in argv)
    except BuildError as e:
        print(e, file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
