"""What a `cubegate` command loads at startup: the tests and scripts run the CLI hundreds of
times, so a command imports only what it uses (cubegate/cli.py: lazy groups, imports inside
the commands). Checked by module, in a fresh interpreter, never by a timer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cubegate.cli import LAZY_GROUPS, load_group, main

REPO = Path(__file__).resolve().parents[2]
# the daemon's stack and the heavy libraries only some commands use
DAEMON_ONLY = {"mitmproxy", "tornado", "pyroute2", "cubevs", "sandbox_runtime", "asyncio"}
NOT_FOR_LOCAL_COMMANDS = DAEMON_ONLY | {"httpx", "vault", "cryptography"}

_PROBE = """
import json, sys
from cubegate.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def _loaded(*args: str, tmp_path: Path, stdin: str = "") -> set[str]:
    r = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=tmp_path, capture_output=True, text=True,
                       input=stdin, timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["code"] in (0, None), r.stderr
    return set(out["modules"])


@pytest.fixture
def settings_file(tmp_path: Path) -> str:
    (tmp_path / "state").mkdir()
    path = tmp_path / "settings.yaml"
    path.write_text(f"state_dir: {tmp_path / 'state'}\n")
    return str(path)


def test_help_loads_no_command_module_dependencies(tmp_path):
    loaded = _loaded("--help", tmp_path=tmp_path)
    assert not loaded & (NOT_FOR_LOCAL_COMMANDS | {"pydantic", "yaml", "egress"}), sorted(loaded)


def test_identity_commands_load_neither_the_daemon_nor_the_vault(tmp_path, settings_file):
    for args in (["identity", "add", "sb-1"], ["identity", "ls"], ["identity", "rm", "sb-1"]):
        loaded = _loaded("-c", settings_file, *args, tmp_path=tmp_path)
        assert "egress" in loaded and "pydantic" in loaded, args     # it did load settings and the store
        assert not loaded & NOT_FOR_LOCAL_COMMANDS, (args, sorted(loaded & NOT_FOR_LOCAL_COMMANDS))


def test_vault_commands_load_the_vault_but_not_the_daemon(tmp_path, settings_file):
    for args, stdin in ((["vault", "init"], ""), (["vault", "secret", "put", "acme", "k1"], "a-long-enough-value\n")):
        loaded = _loaded("-c", settings_file, *args, tmp_path=tmp_path, stdin=stdin)
        assert "vault" in loaded, args
        assert not loaded & (DAEMON_ONLY | {"httpx"}), (args, sorted(loaded & DAEMON_ONLY))


@pytest.mark.parametrize("name", sorted(LAZY_GROUPS))
def test_a_lazy_groups_listed_summary_is_its_own_help(name):
    group = load_group(name)
    assert LAZY_GROUPS[name][1] == group.get_short_help_str(limit=10**6)


def test_help_lists_every_group_and_a_lazy_group_runs(tmp_path):
    from click.testing import CliRunner

    out = CliRunner().invoke(main, ["--help"]).output
    for name in [*LAZY_GROUPS, "identity", "policy", "access", "run"]:
        assert f"\n  {name} " in out, (name, out)
    r = CliRunner().invoke(main, ["vault", "--help"])
    assert r.exit_code == 0 and "secret" in r.output, r.output
