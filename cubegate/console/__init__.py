"""The web console: the daemon's admin side in a browser (console.enabled, loopback only).

Plain server-rendered pages (tornado templates, autoescaped) that work without
JavaScript, plus one small hand-written script (static/console.js) for the live
parts: charts drawn as SVG from the daemon's own metrics, the exec console's
streamed output and the audit tail (server-sent events). No library, no CDN:
every asset is served by the daemon, under a strict Content-Security-Policy.

Login with a vault API token, then a session cookie (httpkit.SessionHandler);
every state change is CSRF-checked and audited with the token id as actor; no
secret value is ever sent to the browser.
"""
