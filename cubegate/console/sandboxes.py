"""Sandboxes: list, create, one sandbox (usage, exec console, destroy, its audit records).

Creation goes the sandbox API's way: the form becomes the API's body, every string of
it is checked for real secret values of the tenant before anything else looks at it,
then the API's model validates it and the manager creates the sandbox.
"""
from __future__ import annotations

import json
import logging
import secrets

import httpkit
from httpkit import ApiError

from cubegate import runtime_models as rm
from cubegate.runtime_api import json_strings
from sandbox_runtime.backend import Limits
from sandbox_runtime.manager import CreateRequest

from . import forms
from .base import ConsoleHandler

EXEC_TIMEOUT_MAX = 600
STREAM_KEEPALIVE = 15.0
RECENT_RECORDS = 20
log = logging.getLogger("cubegate.console")


def owner_tag(session) -> str:
    return session.data.setdefault("tag", secrets.token_hex(8))


class _Sandboxes(ConsoleHandler):
    def runtime(self):
        if self.ctx.runtime is None:
            raise ApiError(503, "runtime_off", "the sandbox runtime is off (settings: runtime.enabled)")
        return self.ctx.runtime


class SandboxesPage(_Sandboxes):
    action = "console.sandboxes"
    template = "sandboxes.html"

    async def page_context(self) -> dict:
        rt = self.ctx.runtime
        if rt is None:
            return {"runtime": None, "sandboxes": [], "memory": {}}
        sandboxes = await self.run(rt.manager.list)
        snap = await self.run(rt.manager.snapshot_for_metrics)
        return {"runtime": rt, "sandboxes": sandboxes, "memory": {sid: n for sid, _, n in snap["memory"]}}

    async def get(self) -> None:
        await self.render_page(self.template)


class SandboxCreate(SandboxesPage):
    action = "console.sandbox.create"

    async def post(self) -> None:
        rt = self.runtime()
        f = self.form("id", "tenant", "backend", "memory_mb", "cpus", "pids", "disk_mb", "labels", "env", "secret_env")
        doc = forms.sandbox_document(f)
        owner = httpkit.parse_body(rm.Owner, json.dumps(doc).encode())     # its errors name id/tenant only
        self.audit.update(sandbox=owner.id, tenant=owner.tenant)
        await self.run(rt.manager.refuse_real_secrets, owner.id, json_strings(json.dumps(doc).encode()),
                       tenant=owner.tenant)
        body = httpkit.parse_body(rm.CreateSandbox, json.dumps(doc).encode())
        limits = Limits(**{**rt.default_limits.__dict__, **body.limits.model_dump(exclude_none=True)})
        req = CreateRequest(sandbox_id=body.id, tenant=body.tenant, backend=body.backend or rt.default_backend,
                            labels=body.labels, limits=limits, env=body.env, secret_env=body.secret_env)
        sb = await self.run(rt.manager.create, req)
        self.done(f"/sandboxes/{sb['id']}", f"sandbox {sb['id']} is running at {sb['ip']} "
                                           f"(started in {sb['start_ms']:.0f} ms)")


class SandboxPage(_Sandboxes):
    action = "console.sandbox"
    template = "sandbox.html"

    async def page_context(self) -> dict:
        sid = self.path_kwargs["id"]
        rt = self.runtime()
        sb = await self.run(rt.manager.get, sid)
        records = await self.run(self.ctx.audit_index.query, sandbox=sid, limit=RECENT_RECORDS)
        return {"sb": sb, "records": records, "exec_job": None}

    async def get(self, id: str) -> None:
        await self.render_page(self.template)


class SandboxExec(SandboxPage):
    """Starts the command as a job. The page's script asks for JSON and streams the job's
    output (ExecEvents); without a script the form waits for the end and shows the output."""
    action = "console.sandbox.exec"
    SUPPORTED_METHODS = ("POST",)

    async def post(self, id: str) -> None:
        rt = self.runtime()
        f = self.form("command", "timeout")
        self.audit["sandbox"] = id
        command = f["command"]
        if not command.strip():
            raise forms.invalid("command: type a command")
        timeout = forms.optional_number(f["timeout"], "timeout", float) or 30.0
        if timeout > EXEC_TIMEOUT_MAX:
            raise forms.invalid(f"timeout: at most {EXEC_TIMEOUT_MAX} seconds")
        argv = ["sh", "-c", command]
        self.audit["program"] = argv[0]     # never the command line: it may carry data

        async def go(job):
            res = await self.run(rt.manager.exec, id, argv, timeout=timeout, on_output=job.output_hook)
            return {"exit_code": res.exit_code, "timed_out": res.timed_out, "duration_s": round(res.duration_s, 3)}
        await self.run(rt.manager.get_record, id)    # 404 now, not in the stream
        job = self.ctx.jobs.start(id, owner_tag(self.session), go)
        if self.request.headers.get("X-Console-Fetch") == "1":
            # this request's record says it started; the job's end gets a record of its own
            job.task.add_done_callback(lambda _t, rec=self._exit_record(job): self._record_exit(job, rec))
            self.send_json({"job": job.id, "events": f"/api/exec/{job.id}/events"}, status=202)
            return
        await job.task
        self.audit["exit_code"] = job.result["exit_code"] if job.result else None
        if job.error:
            raise ApiError(400 if job.result is None else 500, "exec_failed", job.error)
        await self.render_page(self.template, exec_job=job)


    def _exit_record(self, job) -> dict:
        return {"action": "console.sandbox.exec.exit", "actor": self.actor, "sandbox": job.sandbox, "program": "sh",
                "remote": self.request.remote_ip}

    def _record_exit(self, job, rec: dict) -> None:
        ok = job.error is None
        rec.update(status=200 if ok else 500, outcome="ok" if ok else "error", reason=job.error,
                   exit_code=job.result["exit_code"] if job.result else None)
        if self.audit_hook is not None:
            try:
                self.audit_hook(rec)
            except Exception:   # the exec is over; the log line says the audit failed
                log.error("audit of an exec's end failed")


class SandboxDestroy(SandboxPage):
    action = "console.sandbox.destroy"
    SUPPORTED_METHODS = ("POST",)

    async def post(self, id: str) -> None:
        rt = self.runtime()
        self.audit["sandbox"] = id
        await self.run(rt.manager.destroy, id)
        self.done("/sandboxes", f"sandbox {id} destroyed")


class ExecEvents(ConsoleHandler):
    """The job's output as server-sent events: `output` {stream, text}, then `exit` or `failed`."""
    action = "console.sandbox.exec.events"
    kind, touch = "api", False

    async def get(self, job: str) -> None:
        j = self.ctx.jobs.get(job, owner_tag(self.session))
        if j is None:
            raise ApiError(404, "not_found", "no such exec job in this session")
        self.begin_events()
        sent = 0
        while True:
            while sent < len(j.chunks):
                stream, text = j.chunks[sent]
                sent += 1
                if not await self.send_event({"stream": stream, "text": text}, event="output"):
                    return
            if j.done:
                if j.error:
                    await self.send_event({"message": j.error}, event="failed")
                else:
                    await self.send_event(j.result, event="exit")
                break
            await j.wait_change(STREAM_KEEPALIVE)
            if not j.done and sent == len(j.chunks) and not await self.send_comment("keepalive"):
                return
        if not self._finished:
            self.finish()
