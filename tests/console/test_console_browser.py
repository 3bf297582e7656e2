"""The console in a real browser (Debian's chromium, driven by Selenium through chromium-driver).

The real daemon runs in the lab's gateway namespace in transparent mode with the sandbox
runtime on (namespace backend on the cubevs switch, as tests/sandbox_runtime/test_runtime_api.py);
the browser runs here and reaches the console through a loopback forwarder that also
records every byte the console sent it. One walk through every page: log in, readiness,
keyboard navigation, put a secret and bind it, create a sandbox with it as a placeholder,
run a command and watch its output stream, watch a sandbox's denied DNS query arrive in
the audit tail, edit a policy (a broken edit refused in place, then a good one), approve the
access request a sandbox filed, refused requests without CSRF token or session, destroy; then: the secret
is in no page source and in no byte the console ever sent.

Screenshots of each page (1280x800) go to a temporary directory, or to docs/ with
CUBEGATE_CONSOLE_SCREENSHOTS=docs (how the committed ones were made).
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.console.forwarder import Forwarder
from tests.sandbox_runtime.daemonlab import REPO, lab_policy, runtime_api, runtime_daemon, runtime_settings

pytestmark = [pytest.mark.netns, pytest.mark.slow]

CHROMIUM, DRIVER = "/usr/lib/chromium/chromium", "/usr/bin/chromedriver"
TPORT, API_PORT, CONSOLE_PORT, POLICY_PORT = 18174, 18173, 18175, 18176
SECRET = "sk-browser-secret-4b8d2f6a9c1e3057"
POLICY = lab_policy()
WAIT = 20
ASK = ("curl -s --max-time 8 -X POST -H 'Content-Type: application/json' "
       "--data '{\"host\": \"github.test\", \"port\": 443, \"reason\": \"clone the repo\"}' "
       "http://cubegate.internal/v1/access-requests")
# a denied name (the DNS refusal is what the tail must show), then some allowed and denied HTTPS
# so the overview's charts have something to draw (bounded: 6 requests, 3 s each at most)
TRAFFIC = ("getent hosts blocked-by-policy.test; for i in 1 2 3; do "
           "curl -sk -o /dev/null --max-time 3 https://api.allowed.test/; "
           "curl -sk -o /dev/null --max-time 3 --resolve denied.test:443:198.18.0.10 https://denied.test/; "
           "done; true")


def _browser_unavailable() -> str | None:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(DRIVER, os.X_OK)):
        return "needs Debian's chromium and chromium-driver (make setup installs them)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium (the test extra)"
    return None


@pytest.fixture(scope="module")
def console(lab, tmp_path_factory):
    why = _browser_unavailable()
    if why:
        pytest.skip(why)
    tokens = {}

    def before_start(gw):
        gw.cli("vault", "init")
        tokens["admin"] = gw.cli("vault", "token", "create", "--scope", "admin", "--description", "browser").strip()

    settings = {**runtime_settings(API_PORT, memory_mb=1024, cpus=1.0, max_sandboxes=4, host_reserve_mb=256),
                "console": {"enabled": True, "port": CONSOLE_PORT, "sample_seconds": 1.0},
                "policy_api": {"port": POLICY_PORT}}
    with runtime_daemon(lab, tmp_path_factory.mktemp("console"), POLICY, tport=TPORT, prefix="cw",
                        settings=settings, before_start=before_start) as (gw, _):
        fwd = Forwarder(lab.gw_ns, CONSOLE_PORT)
        try:
            yield gw, fwd, tokens["admin"]
        finally:
            fwd.close()
            # a sandbox left by a failed run: the runtime API removes it (the daemon stops after this)
            runtime_api(lab, gw, API_PORT, "DELETE", "/sandboxes/sb-web", timeout=30)


@pytest.fixture
def driver(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-proxy-server",
                "--window-size=1280,800", f"--user-data-dir={tmp_path / 'profile'}", "--no-first-run"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                      {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    d.set_script_timeout(15)
    try:
        yield d
    finally:
        d.quit()


def shots_dir(tmp_path) -> Path:
    if os.environ.get("CUBEGATE_CONSOLE_SCREENSHOTS") == "docs":
        return REPO / "docs"
    return tmp_path


def test_the_console_in_a_browser(console, lab, driver, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    gw, fwd, token = console
    base = fwd.url
    # A form post replaces the page: an element found on the old one goes stale between the
    # find and the read; the next poll finds the new page's (a CI run failed on exactly that).
    wait = WebDriverWait(driver, WAIT,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))
    shots = shots_dir(tmp_path)
    sources: list[str] = []

    def page(path: str) -> None:
        driver.get(base + path)
        wait.until(lambda d: d.execute_script("return document.readyState") == "complete")

    def keep_source() -> None:
        sources.append(driver.page_source)

    def shot(name: str) -> None:
        driver.save_screenshot(str(shots / f"console-{name}.png"))

    def text(css: str) -> str:
        return driver.find_element(By.CSS_SELECTOR, css).text

    # -- log in ----------------------------------------------------------------------
    page("/vault")
    assert driver.current_url == base + "/login"            # no session: the login page
    shot("login")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "login").click()
    wait.until(EC.url_to_be(base + "/"))

    # -- overview: readiness, check by check ---------------------------------------------
    wait.until(lambda d: text("#ready-badge") == "ready")
    rows = {r.get_attribute("data-check"): r.find_elements(By.TAG_NAME, "td")[1].text
            for r in driver.find_elements(By.CSS_SELECTOR, "#checks tbody tr")}
    assert set(rows) >= {"policy", "ca", "listeners", "vault", "audit", "tasks", "runtime"}, rows
    assert set(rows.values()) == {"ok"}, rows
    assert "sandboxes" in text("#cap-budget") and "MB available" in text("#cap-mem")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "figure.chart svg polyline"))   # drawn by the script
    keep_source()

    # -- keyboard: skip link, then the main navigation --------------------------------------
    body = driver.find_element(By.TAG_NAME, "body")
    body.click()
    driver.execute_script("document.activeElement.blur()")
    ActionChains(driver).send_keys(Keys.TAB).perform()
    assert driver.switch_to.active_element.text == "Skip to content"
    ActionChains(driver).send_keys(Keys.TAB, Keys.TAB, Keys.TAB, Keys.TAB).perform()  # Overview … Policies, Vault
    assert driver.switch_to.active_element.text == "Vault"
    ActionChains(driver).send_keys(Keys.ENTER).perform()
    wait.until(EC.url_to_be(base + "/vault"))

    # -- vault: put a secret (write-only), bind it with a placeholder --------------------------
    form = driver.find_element(By.ID, "put-form")
    form.find_element(By.NAME, "tenant").send_keys("acme")
    form.find_element(By.NAME, "id").send_keys("webkey")
    form.find_element(By.NAME, "description").send_keys("echo API key")
    form.find_element(By.NAME, "value").send_keys(SECRET)
    driver.find_element(By.ID, "put").click()
    wait.until(lambda d: "stored acme/webkey v1" in d.find_element(By.CSS_SELECTOR, ".flash").text)
    assert driver.find_element(By.NAME, "value").get_attribute("value") == ""
    keep_source()
    bform = driver.find_element(By.ID, "binding-form")
    for name, value in (("id", "web-echo"), ("tenant", "acme"), ("secret_id", "webkey"),
                        ("hosts", "echo.allowed.test"), ("ports", "443")):
        el = bform.find_element(By.NAME, name)
        el.clear()
        el.send_keys(value)
    bform.find_element(By.NAME, "placeholder").click()
    driver.find_element(By.ID, "add-binding").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-binding="web-echo"]'))
    keep_source()
    shot("vault")

    # -- refused: a state change without the CSRF token, and without the session -------------
    status = driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        fetch('/vault/secrets', {method: 'POST', credentials: 'same-origin',
            body: new URLSearchParams({tenant: 'acme', id: 'nocsrf', value: 'x-no-csrf-value-123456'})})
          .then(r => done(r.status), e => done(String(e)));""")
    assert status == 403
    r = httpx.post(base + "/vault/secrets", data={"tenant": "acme", "id": "nosession", "value": "y" * 24},
                   headers={"Origin": base})
    assert r.status_code == 401
    page("/vault")
    assert "nocsrf" not in driver.page_source and "nosession" not in driver.page_source

    # -- sandboxes: create one, with the secret as a placeholder ----------------------------
    page("/sandboxes")
    cform = driver.find_element(By.ID, "create-form")
    cform.find_element(By.NAME, "id").send_keys("sb-web")
    cform.find_element(By.NAME, "tenant").send_keys("acme")
    cform.find_element(By.NAME, "memory_mb").send_keys("128")
    cform.find_element(By.NAME, "env").send_keys("GREETING=hello-from-the-console")
    cform.find_element(By.NAME, "secret_env").send_keys("API_KEY=webkey")
    driver.find_element(By.ID, "create").click()
    wait.until(EC.url_to_be(base + "/sandboxes/sb-web"))
    assert "running" in text("#sandbox-facts") and text("#sandbox-ip").startswith("10.200.")
    assert "MiB" in text("#sandbox-memory") or "KiB" in text("#sandbox-memory")

    # -- exec console: the output streams (the first line is there while the command sleeps) --
    cmd = driver.find_element(By.ID, "exec-command")
    cmd.send_keys('echo "$GREETING"; echo "$API_KEY" | cut -c1-5; sleep 2; echo done; echo oops >&2; exit 3')
    driver.find_element(By.ID, "exec-run").click()
    wait.until(lambda d: "hello-from-the-console" in text("#exec-output"))
    assert text("#exec-status") == "running…", "the first line came only with the end: not streamed"
    wait.until(lambda d: text("#exec-status").startswith("exit 3"))
    out = text("#exec-output")
    assert out.splitlines() == ["hello-from-the-console", "cgph_", "done", "oops"], out
    assert driver.find_element(By.CSS_SELECTOR, "#exec-output span.stderr").text.strip() == "oops"
    keep_source()
    shot("sandbox")
    page("/sandboxes")
    assert "sb-web" in text("#sandboxes") and "128 MB" in text("#sandboxes")
    keep_source()
    shot("sandboxes")

    # -- policies: a broken edit is refused in place, a good one takes effect; approve a request --
    page("/policies/acme-agents")
    editor = driver.find_element(By.ID, "policy-text")
    original = editor.get_attribute("value")
    assert "api.allowed.test" in original and "file" in text("#policy-source")
    doc = yaml.safe_load(original)
    doc["rules"].append({"name": "typo", "action": "permit", "match": {"hosts": ["*bad.test"]}})
    broken = yaml.safe_dump(doc, sort_keys=False)
    driver.execute_script("arguments[0].value = arguments[1]", editor, broken)
    driver.find_element(By.ID, "policy-save").click()
    wait.until(lambda d: d.find_elements(By.ID, "policy-problems"))
    problems = text("#policy-problems")
    assert "/rules/1/action" in problems and "/rules/1/match/hosts/0" in problems, problems
    assert "action: permit" in driver.find_element(By.ID, "policy-text").get_attribute("value")   # kept
    doc["rules"].pop()
    doc["rules"][0]["match"]["hosts"].append("docs.allowed.test")
    fixed = yaml.safe_dump(doc, sort_keys=False)
    driver.execute_script("arguments[0].value = arguments[1]", driver.find_element(By.ID, "policy-text"), fixed)
    driver.find_element(By.ID, "policy-save").click()
    wait.until(lambda d: "is in force" in d.find_element(By.CSS_SELECTOR, ".flash").text)
    assert "API policy, version 1" in text("#policy-source")
    keep_source()
    shot("policy")
    r = runtime_api(lab, gw, API_PORT, "POST", "/sandboxes/sb-web/exec", timeout=30,
                    json={"argv": ["sh", "-c", ASK], "timeout": 15})
    assert r.status_code == 200 and '"state": "pending"' in r.json()["stdout"].replace('":"', '": "'), r.text
    page("/policies")
    row = driver.find_element(By.CSS_SELECTOR, "#access-requests tbody tr[data-request]")
    assert "github.test:443" in row.text and "sb-web" in row.text
    row.find_element(By.NAME, "scope").send_keys("sandbox")
    row.find_element(By.CSS_SELECTOR, "form.rotate button").click()
    wait.until(lambda d: "approved github.test:443" in d.find_element(By.CSS_SELECTOR, ".flash").text)
    assert "github.test" in text("#grants") and not driver.find_elements(By.CSS_SELECTOR, "#access-requests tr[data-request]")
    page("/policies/explain?sandbox=sb-web&labels=tenant%3Dacme&host=github.test")
    assert "grant_allow" in text("#explain-result")
    keep_source()
    shot("policies")

    # -- audit: a new record appears in the live tail ------------------------------------------
    page("/audit")
    wait.until(lambda d: text("#tail-state") == "live")
    r = runtime_api(lab, gw, API_PORT, "POST", "/sandboxes/sb-web/exec", timeout=30,
                    json={"argv": ["sh", "-c", TRAFFIC], "timeout": 30})
    assert r.status_code == 200, r.text
    wait.until(lambda d: "blocked-by-policy.test" in text("#tail-records"))
    row = [tr.text for tr in driver.find_elements(By.CSS_SELECTOR, "#tail-records tbody tr")
           if "blocked-by-policy.test" in tr.text][0]
    assert "deny" in row and "sb-web" in row, row
    keep_source()
    shot("audit")

    # -- destroy --------------------------------------------------------------------------
    page("/sandboxes/sb-web")
    driver.find_element(By.ID, "destroy").click()
    driver.switch_to.alert.accept()
    wait.until(EC.url_to_be(base + "/sandboxes"))
    assert "sb-web" not in text("#sandboxes")

    # -- overview again, with the denied host counted ------------------------------------------
    page("/")
    wait.until(lambda d: "blocked-by-policy.test" in text("#top-denied"))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "figure.chart svg polyline"))
    if shots != tmp_path:
        time.sleep(1.5)   # one more sample, so the committed screenshot's charts show the burst
    keep_source()
    shot("overview")

    # -- the secret never reached the browser -------------------------------------------------
    forms = (SECRET, base64.b64encode(SECRET.encode()).decode(), SECRET[4:-4])
    for src in sources:
        assert not any(f in src for f in forms)
    served = fwd.served()
    assert b"hello-from-the-console" in served and b"blocked-by-policy.test" in served   # it did record
    assert not any(f.encode() in served for f in forms)
    log = driver.get_log("browser")   # no CSP violation, no script error (the refused fetch above is "network")
    assert not [e for e in log if e["level"] == "SEVERE" and e["source"] != "network"], log
    assert not [e for e in log if "Content Security Policy" in e["message"]], log
    # every console action is in the audit log with its actor
    actions = {rec["extra"].get("action") for rec in gw.audit_records() if rec.get("event") == "admin"}
    assert {"console.login", "console.secret.put", "console.binding.add", "console.sandbox.create",
            "console.sandbox.exec", "console.sandbox.exec.exit", "console.sandbox.destroy", "console.policy.put",
            "console.access.approve"} <= actions, actions
    assert SECRET not in json.dumps(gw.audit_records()) and SECRET not in gw.log()
    if shots != tmp_path:
        shutil.rmtree(tmp_path / "profile", ignore_errors=True)
