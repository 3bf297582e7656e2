"""Runs the real e2b / e2b-code-interpreter SDKs (E2B_* variables set by the caller) and
prints what it observed as one JSON line: the assertions live in test_e2b_sdk.py.
Run inside the namespace where the daemon's loopback API listens:
    python -m tests.e2b.sdk_driver SCENARIO [ARG...]"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _exc(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - the type is what is observed
        return {"type": type(e).__name__, "message": str(e)[:500]}


def lifecycle(out: dict) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState
    sbx = Sandbox.create(template="base", timeout=120, envs={"GREETING": "hello"}, metadata={"suite": "e2b-a"})
    other = Sandbox.create(timeout=120, metadata={"suite": "e2b-a"})
    try:
        info = sbx.get_info()
        out["info"] = {"id": info.sandbox_id, "template": info.template_id, "metadata": info.metadata,
                       "state": str(info.state.value), "cpu": info.cpu_count, "mem": info.memory_mb,
                       "window": (info.end_at - info.started_at).total_seconds()}
        out["running"] = sbx.is_running()
        pages, p = [], Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b-a"}), limit=1)
        while p.has_next:
            pages.append([s.sandbox_id for s in p.next_items()])
        out["pages"] = pages
        out["ids"] = sorted([sbx.sandbox_id, other.sandbox_id])
        sbx.set_timeout(600)
        out["window_after"] = (sbx.get_info().end_at - sbx.get_info().started_at).total_seconds()
        m = sbx.get_metrics()
        out["metrics"] = {"n": len(m), "mem_total": m[0].mem_total if m else None, "mem_used": m[0].mem_used if m else None}
        # commands
        chunks_out, chunks_err = [], []
        r = sbx.commands.run("echo $GREETING; echo oops >&2; pwd; whoami; id -u", on_stdout=chunks_out.append,
                             on_stderr=chunks_err.append)
        out["run"] = {"stdout": r.stdout, "stderr": r.stderr, "exit": r.exit_code,
                      "cb_out": "".join(chunks_out), "cb_err": "".join(chunks_err)}
        e = _exc(lambda: sbx.commands.run("exit 7"))
        from e2b import CommandExitException
        try:
            sbx.commands.run("echo before; exit 7")
        except CommandExitException as ce:
            out["exit_exc"] = {"type": type(ce).__name__, "code": ce.exit_code, "stdout": ce.stdout}
        out["exit_exc_any"] = e
        t0 = time.monotonic()
        live = []
        sbx.commands.run("for i in 1 2 3; do echo tick$i; sleep 0.4; done",
                         on_stdout=lambda s: live.append((round(time.monotonic() - t0, 2), s)))
        out["live"] = live
        h = sbx.commands.run("read line; echo got:$line; sleep 30", background=True, stdin=True)
        out["listed"] = [p.pid for p in sbx.commands.list()]
        out["bg_pid"] = h.pid
        sbx.commands.send_stdin(h.pid, "abc\n")
        time.sleep(0.5)
        again = sbx.commands.connect(h.pid)
        out["killed"] = again.kill()
        try:
            again.wait()
            out["after_kill"] = None
        except CommandExitException as ce:
            out["after_kill"] = {"type": type(ce).__name__, "code": ce.exit_code, "stdout": ce.stdout}
        out["listed_after"] = [p.pid for p in sbx.commands.list()]
        h2 = sbx.commands.run("sleep 0.3; echo done-bg", background=True)
        out["bg_wait"] = h2.wait().stdout
        out["kill_gone"] = sbx.commands.kill(999999)
        out["envs_per_cmd"] = sbx.commands.run("echo $ONLY_HERE", envs={"ONLY_HERE": "x1"}).stdout
        out["cwd_cmd"] = sbx.commands.run("pwd", cwd="/tmp").stdout
        # files
        sbx.files.write("notes/hello.txt", "hi there")
        out["read_text"] = sbx.files.read("notes/hello.txt")
        blob = bytes(range(256)) * 4096 * 20 + b"tail"      # 20 MiB + 4: more than one agent frame
        sbx.files.write("/home/user/big.bin", blob)
        back = sbx.files.read("/home/user/big.bin", format="bytes")
        out["big"] = {"len": len(back), "same": bytes(back) == blob}
        out["exists"] = [sbx.files.exists("notes/hello.txt"), sbx.files.exists("notes/nope")]
        gi = sbx.files.get_info("notes/hello.txt")
        out["info_file"] = {"name": gi.name, "type": str(gi.type.value), "size": gi.size, "path": gi.path}
        out["mkdir"] = [sbx.files.make_dir("d1/d2"), sbx.files.make_dir("d1/d2")]
        sbx.files.rename("notes/hello.txt", "d1/moved.txt")
        out["list"] = sorted((e.name, str(e.type.value)) for e in sbx.files.list("d1"))
        out["list_depth2"] = sorted(e.path for e in sbx.files.list("/home/user/d1", depth=2))
        sbx.files.remove("d1")
        out["exists_after_remove"] = sbx.files.exists("d1")
        out["read_missing"] = _exc(lambda: sbx.files.read("no/such/file"))
        # pause, resume through connect
        paused = sbx.pause()
        out["paused_state"] = str(sbx.get_info().state.value)
        again = Sandbox.connect(sbx.sandbox_id)
        out["resumed_state"] = str(again.get_info().state.value)
        out["after_resume"] = again.commands.run("echo alive").stdout
        out["paused_ret"] = paused
    finally:
        out["kill"] = [sbx.kill(), other.kill(), Sandbox.kill(other.sandbox_id)]
    out["running_after_kill"] = sbx.is_running()
    out["connect_killed"] = _exc(lambda: Sandbox.connect(sbx.sandbox_id))
    out["unknown_template"] = _exc(lambda: Sandbox.create(template="no-such-template"))
    out["network_opt"] = _exc(lambda: Sandbox.create(network={"dns_servers": ["1.1.1.1"]}))


def code(out: dict) -> None:
    from e2b_code_interpreter import Sandbox
    sbx = Sandbox.create(timeout=120)
    try:
        ex = sbx.run_code("x = 40\nprint('side effect')\nx + 2")
        out["first"] = {"stdout": ex.logs.stdout, "text": ex.text, "error": ex.error is not None}
        ex = sbx.run_code("x * 10")
        out["state"] = ex.text
        seen = []
        ex = sbx.run_code("import os\nprint(os.environ.get('ONLY_CELL'))\n1/0", envs={"ONLY_CELL": "cell-env"},
                          on_stdout=lambda m: seen.append(m.line))
        out["error"] = {"name": ex.error.name, "value": ex.error.value, "tb": "ZeroDivisionError" in ex.error.traceback,
                        "stdout": ex.logs.stdout, "cb": seen}
        out["after_error"] = sbx.run_code("x").text
        out["cmd_too"] = sbx.commands.run("echo from-shell").stdout
    finally:
        sbx.kill()


def network(out: dict, ca_pem_path: str) -> None:
    from e2b import Sandbox
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/ca.pem", open(ca_pem_path).read())
        curl = "curl -s -o /dev/null -w '%{http_code}' --max-time 10 --cacert /home/user/ca.pem "
        out["allowed"] = sbx.commands.run(curl + "https://api.allowed.test/e2b-allowed").stdout
        out["denied"] = _exc(lambda: sbx.commands.run(curl + "https://denied.test/e2b-denied"))
        out["placeholder"] = sbx.commands.run("echo $CUBEGATE_PLACEHOLDER_OPENAI").stdout.strip()
        r = sbx.commands.run('curl -s --max-time 10 --cacert /home/user/ca.pem '
                             '-H "Authorization: Bearer $CUBEGATE_PLACEHOLDER_OPENAI" https://echo.allowed.test/e2b-inject')
        out["echo"] = json.loads(r.stdout)
        out["sid"] = sbx.sandbox_id
    finally:
        sbx.kill()


def network_opts(out: dict, ca_pem_path: str) -> None:
    """E2B network options narrow what the tenant's policy allows, never widen it."""
    from e2b import ALL_TRAFFIC, Sandbox
    curl = "curl -s -o /dev/null -w '%{http_code}' --max-time 8 --cacert /home/user/ca.pem "
    cases = {"only_api": dict(network={"allow_out": ["api.allowed.test", "evil.test"], "deny_out": [ALL_TRAFFIC]}),
             "deny_echo": dict(network={"deny_out": ["echo.allowed.test"]}),
             "no_internet": dict(allow_internet_access=False)}
    for name, kw in cases.items():
        sbx = Sandbox.create(timeout=120, **kw)
        try:
            sbx.files.write("/home/user/ca.pem", open(ca_pem_path).read())
            got = {}
            for host in ("api.allowed.test", "echo.allowed.test", "evil.test"):
                r = sbx.commands.run(curl + f"https://{host}/e2b-{name}; true", timeout=30)
                got[host] = r.stdout
            out[name] = got
        except Exception as e:  # noqa: BLE001 - a denied curl exits non-zero: that is an observation too
            out[name] = {"error": type(e).__name__, "stdout": getattr(e, "stdout", None)}
        finally:
            sbx.kill()


def secrets(out: dict, secret: str) -> None:
    from e2b import Sandbox
    out["create_env"] = _exc(lambda: Sandbox.create(envs={"KEY": secret}))
    out["create_meta"] = _exc(lambda: Sandbox.create(metadata={"k": secret}))
    sbx = Sandbox.create(timeout=60)
    try:
        out["cmd"] = _exc(lambda: sbx.commands.run(f"echo {secret} > /tmp/k"))
        out["cmd_env"] = _exc(lambda: sbx.commands.run("true", envs={"K": secret}))
        out["write"] = _exc(lambda: sbx.files.write("k.txt", f"key={secret}"))
        out["file_there"] = sbx.files.exists("k.txt")
        out["ok_cmd"] = sbx.commands.run("echo fine").stdout
    finally:
        sbx.kill()


def ttl(out: dict) -> None:
    from e2b import Sandbox
    sbx = Sandbox.create(timeout=2)
    out["running_before"] = sbx.is_running()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and sbx.is_running():
        time.sleep(0.5)
    out["running_after"] = sbx.is_running()
    out["listed"] = sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
    out["waited_s"] = round(15 - (deadline - time.monotonic()), 1)


def main() -> None:
    out: dict = {}
    try:
        globals()[sys.argv[1]](out, *sys.argv[2:])
    except Exception:  # noqa: BLE001
        out["driver_error"] = traceback.format_exc()[-3000:]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
