"""The plain-HTTP path's request-stage decisions, cached (one cache per FastPath).

A keep-alive agent repeats the same requests: the policy object in force decides each
(sandbox, labels, host, port, literal?, scheme, method, path) once. The staleness rule is
egress.destination.DecisionCache's (a new policy object or a grant's expiry empties it);
the key is the whole RequestInfo, so a hit is the decision the policy would make again
(tests/gateway/test_plain_cost.py compares the two on generated policies and requests).
"""
from __future__ import annotations

from egress.destination import DecisionCache
from egress.policy import RequestInfo

MAX_PATH = 256     # longer paths (query strings with ids) are decided each time: bounded key memory


class RequestDecisionCache(DecisionCache):
    def _key(self, req: RequestInfo) -> tuple | None:
        path = req.path
        if path is not None and len(path) > MAX_PATH:
            return None
        return (req.sandbox_id, tuple(sorted(req.labels.items())), req.host, req.port, req.is_ip_literal,
                req.scheme, req.method, path)
