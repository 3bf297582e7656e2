"""What JSON and page handlers share: an exception as the one error shape, and the audit
record (with its outcome word) when a request finishes."""
from __future__ import annotations

import logging
import traceback
from typing import Callable

import tornado.web

from .errors import ApiError, ErrorMap, to_api_error

AuditHook = Callable[[dict], None]
log = logging.getLogger("httpkit")


class AuditedHandler(tornado.web.RequestHandler):
    action = "unknown"
    error_map: ErrorMap = ()
    audit_hook: AuditHook | None = None

    def audit_record(self) -> dict | None:
        """The record for audit_hook when the request is done (None: nothing to record)."""
        return None

    def api_error(self, e: BaseException) -> ApiError:
        """`e` mapped by error_map, or a bare 500 logged by its type and where it was raised:
        never its text or locals, they may hold request data."""
        err = to_api_error(e, self.error_map)
        if err is not None:
            return err
        frame = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
        where = f" at {frame[0].filename}:{frame[0].lineno}" if frame else ""
        log.error("%s: internal error %s in %s%s", type(self).__module__, type(e).__name__, self.action, where)
        return ApiError(500, "internal", "internal error")

    def on_finish(self) -> None:
        if self.audit_hook is None:
            return
        record = self.audit_record()
        if record is None:
            return
        try:
            self.audit_hook(record)
        except Exception as e:  # the action is done; make the failure visible
            log.error("%s: audit hook failed: %s", type(self).__module__, type(e).__name__)

    def outcome(self) -> str:
        status = self.get_status()
        return "ok" if status < 400 else ("denied" if status in (401, 403) else "error")
