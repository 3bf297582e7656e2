"""E2B-compatible API: the unmodified `e2b` / `e2b-code-interpreter` SDKs run against cubegate.

    control.py    the control plane (REST+JSON, X-API-Key): create/list/connect/kill/...
    envd.py       the in-sandbox daemon's protocol (Connect+JSON over HTTP/1.1): process,
                  filesystem, /files, /health; and the code interpreter's /execute
    connect.py    Connect protocol framing and error codes (pure)
    templates.py  template id -> backend + limits (pure)
    registry.py   the E2B view of a sandbox (metadata, end time, envd token), persisted
    kernel.py     the small Python kernel run inside a sandbox for run_code
    service.py    wiring into the daemon (server, TTL reaper)

Everything goes through the SandboxManager, so the vault's secret checks, admission,
the switch and the tenant's egress policy apply as for cubegate's own API.
"""
