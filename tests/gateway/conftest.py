import pytest

from tests.gateway.harness import Gateway

MAIN_POLICY = """\
name: test-default
default: deny
rules:
  - name: lab-apis
    action: allow
    match:
      hosts: [api.allowed.test, passthrough.allowed.test, echo.allowed.test, redirect.allowed.test, rebind.allowed.test]
      ports: [443, 80]
  - name: github
    action: allow
    match: {hosts: ["*.github.test"], ports: [443]}
  - name: evil-names          # allowed by policy so that the SSRF guard is what refuses them
    action: allow
    match: {hosts: ["*.evil.test"], ports: [443, 80]}
  - name: echo-admin
    action: deny
    match: {hosts: [echo.allowed.test], paths: [/admin]}
  - name: lab-literal
    action: allow
    match: {cidrs: [198.18.0.10/32], ports: [443]}
"""

REPORT_POLICY = """\
name: report-only
applies_to: {sandboxes: [sb-report]}
mode: report
default: deny
rules:
  - name: api
    action: allow
    match: {hosts: [api.allowed.test]}
"""

SEED_POLICY = """\
name: seed-team
applies_to: {labels: {team: seed}}
egress: {allowed_domains: [api.allowed.test, "*.github.test"], denied_domains: ["*"]}
"""


@pytest.fixture(scope="module")
def gateway(lab, tmp_path_factory):
    gw = Gateway(lab, tmp_path_factory.mktemp("gw"),
                 {"main.yaml": MAIN_POLICY, "report.yaml": REPORT_POLICY, "seed.yaml": SEED_POLICY},
                 sandboxes={"sb-1": {"team": "a"}, "sb-2": {"team": "b"}, "sb-report": {},
                            "sb-seed": {"team": "seed"}})
    gw.start()
    yield gw
    gw.stop()
