"""Table-driven decide() tests over one rich policy set."""

import pytest

from egress.policy import RequestInfo

from policy_testlib import req

RICH = """
name: agents-default
tenant: acme
rules:
  - name: openai
    action: allow
    match: {hosts: [api.openai.com], ports: [443], schemes: [https], methods: [GET, POST], paths: [/v1/]}
  - name: openai-files-deny
    action: deny
    match: {hosts: [api.openai.com], paths: [/v1/files]}
  - name: openai-files-public
    action: allow
    match: {hosts: [api.openai.com], paths: [/v1/files/public]}
  - name: github
    action: allow
    match: {hosts: ["*.github.com"]}
  - name: no-admin
    action: deny
    match: {hosts: ["*.github.com"], paths: [/admin]}
  - name: raw-github-deny
    action: deny
    match: {hosts: ["*.raw.github.com"]}
  - name: gist-exact
    action: allow
    match: {hosts: [gist.raw.github.com]}
  - name: wide-allow
    action: allow
    match: {hosts: ["*.example.com"]}
  - name: narrow-deny
    action: deny
    match: {hosts: [bad.example.com]}
  - name: same-spec-allow
    action: allow
    match: {hosts: [tie.test]}
  - name: same-spec-deny-get
    action: deny
    match: {hosts: [tie.test], methods: [DELETE]}
  - name: ssh-nowhere
    action: deny
    match: {ports: [22]}
  - name: internal-api
    action: allow
    match: {cidrs: [198.18.0.0/24], ports: [443]}
  - name: internal-bad
    action: deny
    match: {cidrs: [198.18.0.128/25]}
  - name: internal-hole
    action: allow
    match: {cidrs: [198.18.0.200/32]}
  - name: v6
    action: allow
    match: {cidrs: ["2001:db8::/64"]}
  - name: idn
    action: allow
    match: {hosts: ["bücher.example"]}
  - name: plain-http-only
    action: allow
    match: {hosts: [plain.test], schemes: [http], ports: [80]}
global:
  denied_domains: ["*.evil.test", very.bad.example.com]
  denied_cidrs: [198.18.0.99/32]
"""

# (host, port, scheme, method, path, ip) -> (action, reason, rule, needs_inspection)
CASES = [
    # exact host with method/path constraints
    (("api.openai.com", 443, "https", "GET", "/v1/chat"), ("allow", "rule_allow", "openai", False)),
    (("api.openai.com", 443, "https", "DELETE", "/v1/chat"), ("deny", "default_deny", None, False)),
    (("api.openai.com", 443, "https", "GET", "/v2/chat"), ("deny", "default_deny", None, False)),
    (("api.openai.com", 443, "http", "GET", "/v1/chat"), ("deny", "default_deny", None, False)),
    (("api.openai.com", 8443, "https", "GET", "/v1/chat"), ("deny", "default_deny", None, False)),
    # longest path prefix wins, in both directions
    (("api.openai.com", 443, "https", "GET", "/v1/files/x"), ("deny", "rule_deny", "openai-files-deny", False)),
    (("api.openai.com", 443, "https", "GET", "/v1/files/public/x"), ("allow", "rule_allow", "openai-files-public", False)),
    (("api.openai.com", 443, "https", "GET", "/v1/filesystem"), ("allow", "rule_allow", "openai", False)),
    # path normalisation cannot sidestep a deny
    (("api.openai.com", 443, "https", "GET", "/v1/chat/../files/x"), ("deny", "rule_deny", "openai-files-deny", False)),
    (("api.openai.com", 443, "https", "GET", "/v1//files/x"), ("deny", "rule_deny", "openai-files-deny", False)),
    (("api.openai.com", 443, "https", "GET", "/v1/%66iles/x"), ("deny", "rule_deny", "openai-files-deny", False)),
    (("api.openai.com", 443, "https", "GET", "/v1/x/..;/files/x"), ("deny", "rule_deny", "openai-files-deny", False)),
    (("api.openai.com", 443, "https", "GET", "/v1/files%2Fx"), ("deny", "invalid_path", None, False)),
    # CONNECT stage: outcome depends on method/path -> inspect
    (("api.openai.com", 443, None, None, None), ("allow", "inspect_required", None, True)),
    (("api.openai.com", 443, "https", None, None), ("allow", "inspect_required", None, True)),
    # port 80: only the path-only rules can match, and one of them allows
    (("api.openai.com", 80, None, None, None), ("allow", "inspect_required", None, True)),
    (("api.openai.com", 80, "http", "GET", "/v1/chat"), ("deny", "default_deny", None, False)),
    (("api.openai.com", 80, "http", "GET", "/v1/files/public/a"), ("allow", "rule_allow", "openai-files-public", False)),
    # wildcard edge cases
    (("a.github.com", 443, None, "GET", "/"), ("allow", "rule_allow", "github", False)),
    (("a.b.github.com", 443, None, "GET", "/"), ("allow", "rule_allow", "github", False)),
    (("github.com", 443, None, None, None), ("deny", "default_deny", None, False)),
    (("evil-github.com", 443, None, None, None), ("deny", "default_deny", None, False)),
    (("github.com.evil.net", 443, None, None, None), ("deny", "default_deny", None, False)),
    (("agithub.com", 443, None, None, None), ("deny", "default_deny", None, False)),
    # wildcard + path deny at same specificity; a path rule is more specific
    (("a.github.com", 443, None, "GET", "/admin/users"), ("deny", "rule_deny", "no-admin", False)),
    (("a.github.com", 443, None, "GET", "/administrator"), ("allow", "rule_allow", "github", False)),
    (("a.github.com", 443, None, None, None), ("allow", "inspect_required", None, True)),
    # longer wildcard suffix beats shorter; exact beats wildcard
    (("x.raw.github.com", 443, None, None, None), ("deny", "rule_deny", "raw-github-deny", False)),
    (("raw.github.com", 443, None, None, None), ("allow", "inspect_required", None, True)),
    (("gist.raw.github.com", 443, None, "GET", "/admin"), ("allow", "rule_allow", "gist-exact", False)),
    (("gist.raw.github.com", 443, None, None, None), ("allow", "rule_allow", "gist-exact", False)),
    (("bad.example.com", 443, None, None, None), ("deny", "rule_deny", "narrow-deny", False)),
    (("good.example.com", 443, None, None, None), ("allow", "rule_allow", "wide-allow", False)),
    (("example.com", 443, None, None, None), ("deny", "default_deny", None, False)),
    # equal specificity: deny wins when both match; allow stands when deny's method does not match
    (("tie.test", 443, None, "DELETE", "/"), ("deny", "rule_deny", "same-spec-deny-get", False)),
    (("tie.test", 443, None, "GET", "/"), ("allow", "rule_allow", "same-spec-allow", False)),
    (("tie.test", 443, None, None, None), ("allow", "inspect_required", None, True)),
    # hostless rule: only port-filtered, least specific
    (("nothing.test", 22, None, None, None), ("deny", "rule_deny", "ssh-nowhere", False)),
    (("good.example.com", 22, None, None, None), ("allow", "rule_allow", "wide-allow", False)),
    # global deny beats any rule
    (("very.bad.example.com", 443, None, None, None), ("deny", "global_deny", None, False)),
    (("x.evil.test", 443, None, None, None), ("deny", "global_deny", None, False)),
    (("metadata.google.internal", 80, None, None, None), ("deny", "global_deny", None, False)),
    (("METADATA.Google.Internal.", 80, None, None, None), ("deny", "global_deny", None, False)),
    (("metadata", 80, None, None, None), ("deny", "global_deny", None, False)),
    (("sub.localhost", 80, None, None, None), ("deny", "global_deny", None, False)),
    # case, trailing dot, port in host, IDN
    (("API.OPENAI.COM.", 443, "https", "GET", "/v1/x"), ("allow", "rule_allow", "openai", False)),
    (("api.openai.com:443", 443, "https", "GET", "/v1/x"), ("allow", "rule_allow", "openai", False)),
    (("Bücher.example", 443, None, None, None), ("allow", "rule_allow", "idn", False)),
    (("xn--bcher-kva.example", 443, None, None, None), ("allow", "rule_allow", "idn", False)),
    # invalid hosts
    (("", 443, None, None, None), ("deny", "invalid_host", None, False)),
    (("a..openai.com", 443, None, None, None), ("deny", "invalid_host", None, False)),
    (("198.18.1", 443, None, None, None), ("deny", "invalid_host", None, False)),
    (("api.openai.com", 0, None, None, None), ("deny", "invalid_port", None, False)),
    (("api.openai.com", 70000, None, None, None), ("deny", "invalid_port", None, False)),
    # IP literals only via cidrs; longest prefix wins
    (("198.18.0.5", 443, None, None, None), ("allow", "rule_allow", "internal-api", False)),
    (("198.18.0.5", 80, None, None, None), ("deny", "ip_literal_not_allowed", None, False)),
    (("198.18.0.130", 443, None, None, None), ("deny", "rule_deny", "internal-bad", False)),
    (("198.18.0.200", 443, None, None, None), ("allow", "rule_allow", "internal-hole", False)),
    (("198.18.0.99", 443, None, None, None), ("deny", "global_deny", None, False)),
    (("169.254.169.254", 80, None, None, None), ("deny", "global_deny", None, False)),
    (("[::ffff:169.254.169.254]", 80, None, None, None), ("deny", "global_deny", None, False)),
    (("8.8.8.8", 443, None, None, None), ("deny", "ip_literal_not_allowed", None, False)),
    (("[2001:db8::5]:443", 443, None, None, None), ("allow", "rule_allow", "v6", False)),
    (("2001:db8:0:1::5", 443, None, None, None), ("deny", "ip_literal_not_allowed", None, False)),
    # scheme constraints
    (("plain.test", 80, "http", "GET", "/"), ("allow", "rule_allow", "plain-http-only", False)),
    (("plain.test", 80, "https", "GET", "/"), ("deny", "default_deny", None, False)),
    (("plain.test", 80, None, None, None), ("allow", "inspect_required", None, True)),
    (("plain.test", 80, "HTTP", "get", "/"), ("allow", "rule_allow", "plain-http-only", False)),
]


@pytest.fixture(scope="module")
def rich(tmp_path_factory):
    from egress.policy import load_policy_files

    from policy_testlib import write

    d = tmp_path_factory.mktemp("rich")
    return load_policy_files([write(d, "rich.yaml", RICH)])


@pytest.mark.parametrize("request_, expected", CASES, ids=[f"{c[0][0]}:{c[0][1]}{c[0][4] or ''}-{c[0][3] or ''}" for c in CASES])
def test_decide_table(rich, request_, expected):
    host, port, scheme, method, path = request_
    d = rich.decide(req(host, port, scheme=scheme, method=method, path=path))
    assert (d.action, d.reason, d.rule, d.needs_inspection) == expected
    assert d.mode == "enforce" and d.would_deny is False
    if d.reason not in ("no_policy",):
        assert d.policy == "agents-default" and d.tenant == "acme"


def test_ip_literal_flag_without_ip_host_is_invalid(rich):
    d = rich.decide(req("api.openai.com", ip=True))
    assert (d.action, d.reason) == ("deny", "invalid_host")


def test_default_allow_never_allows_ip_literals(load):
    ps = load("""
    name: open
    default: allow
    rules:
      - {name: x, action: deny, match: {hosts: [blocked.test]}}
    """)
    assert ps.decide(req("anything.test")).reason == "default_allow"
    assert ps.decide(req("anything.test")).action == "allow"
    assert ps.decide(req("blocked.test")).action == "deny"
    d = ps.decide(req("93.184.216.34", ip=True))
    assert (d.action, d.reason) == ("deny", "ip_literal_not_allowed")


def test_connect_stage_final_when_all_candidates_agree(load):
    ps = load("""
    name: p
    rules:
      - {name: a, action: allow, match: {hosts: [a.test], methods: [GET]}}
      - {name: b, action: allow, match: {hosts: [a.test], methods: [POST]}}
      - {name: c, action: allow, match: {hosts: [a.test]}}
    """)
    d = ps.decide(req("a.test"))
    assert (d.action, d.reason, d.rule, d.needs_inspection) == ("allow", "rule_allow", "c", False)


def test_connect_stage_deny_with_possible_allow_needs_inspection(load):
    ps = load("""
    name: p
    rules:
      - {name: a, action: allow, match: {hosts: [a.test], methods: [GET]}}
    """)
    d = ps.decide(req("a.test"))
    assert (d.action, d.reason, d.needs_inspection) == ("allow", "inspect_required", True)
    assert ps.decide(req("a.test", method="GET", path="/")).reason == "rule_allow"
    assert ps.decide(req("a.test", method="POST", path="/")).reason == "default_deny"


def test_report_mode(load):
    ps = load("""
    name: watch
    mode: report
    rules:
      - {name: ok, action: allow, match: {hosts: [ok.test]}}
      - {name: nope, action: deny, match: {hosts: [no.test]}}
    """)
    d = ps.decide(req("no.test"))
    assert (d.action, d.reason, d.rule, d.mode, d.would_deny) == ("allow", "rule_deny", "nope", "report", True)
    d = ps.decide(req("other.test"))
    assert (d.action, d.reason, d.would_deny) == ("allow", "default_deny", True)
    d = ps.decide(req("ok.test"))
    assert (d.action, d.reason, d.would_deny) == ("allow", "rule_allow", False)
    d = ps.decide(req("8.8.8.8", ip=True))
    assert (d.action, d.reason, d.would_deny) == ("allow", "ip_literal_not_allowed", True)
    # global denies and invalid input stay enforced in report mode
    d = ps.decide(req("metadata.google.internal"))
    assert (d.action, d.reason, d.would_deny) == ("deny", "global_deny", False)
    assert ps.decide(req("")).action == "deny"


SELECTION = """
policies:
  - name: fallback
    rules: [{name: a, action: allow, match: {hosts: [fallback.test]}}]
  - name: by-id
    applies_to: {sandboxes: [sb-special]}
    tenant: special
    rules: [{name: a, action: allow, match: {hosts: [id.test]}}]
  - name: research
    applies_to: {labels: {team: research}}
    rules: [{name: a, action: allow, match: {hosts: [research.test]}}]
  - name: research-prod
    applies_to: {labels: {team: research, env: prod}}
    rules: [{name: a, action: allow, match: {hosts: [prod.test]}}]
  - name: a-env-prod
    applies_to: {labels: {env: prod}}
    rules: []
  - name: id-and-labels
    applies_to: {sandboxes: [sb-both], labels: {team: both}}
    rules: []
"""


@pytest.mark.parametrize("sb, labels, policy", [
    ("sb-1", {}, "fallback"),
    ("sb-1", {"team": "other"}, "fallback"),
    ("sb-special", {"team": "research", "env": "prod"}, "by-id"),  # id beats labels
    ("sb-1", {"team": "research"}, "research"),
    ("sb-1", {"team": "research", "env": "prod", "x": "y"}, "research-prod"),  # most labels
    ("sb-1", {"env": "prod"}, "a-env-prod"),
    ("sb-1", {"team": "both"}, "id-and-labels"),
    ("sb-both", {}, "id-and-labels"),
    ("sb-1", {"team": "Research"}, "fallback"),  # label values are exact
])
def test_policy_selection(load, sb, labels, policy):
    ps = load(SELECTION)
    assert ps.policy_for(sb, labels).name == policy
    assert ps.decide(req("x.test", sb=sb, labels=labels)).policy == policy


def test_equal_label_count_tie_is_alphabetical(load):
    ps = load("""
    policies:
      - name: zeta
        applies_to: {labels: {team: research}}
      - name: alpha
        applies_to: {labels: {env: prod}}
    """)
    assert ps.policy_for("s", {"team": "research", "env": "prod"}).name == "alpha"


def test_no_policy_denies(load):
    ps = load("""
    name: only-team
    applies_to: {labels: {team: a}}
    default: allow
    """)
    d = ps.decide(req("x.test", labels={"team": "b"}))
    assert (d.action, d.reason, d.policy, d.tenant) == ("deny", "no_policy", None, None)
    assert ps.decide(req("x.test", labels={"team": "a"})).action == "allow"
    assert ps.name_may_resolve("s", {"team": "b"}, "x.test") is False


def test_name_may_resolve(rich):
    may = rich.hosts_allowed("sb-1", {})
    assert may("api.openai.com") is True          # allowed for some requests
    assert may("API.OpenAI.com.") is True
    assert may("a.github.com") is True
    assert may("x.raw.github.com") is False       # denied whatever the request
    assert may("nothing.test") is False           # default deny (port 22 deny irrelevant)
    assert may("very.bad.example.com") is False   # global deny
    assert may("metadata.google.internal") is False
    assert may("198.18.0.5") is False             # IPs are not names
    assert may("") is False
    assert rich.name_may_resolve("sb-1", {}, "good.example.com") is True


def test_report_mode_may_resolve_everything_but_global(load):
    ps = load("name: r\nmode: report\n")
    assert ps.name_may_resolve("s", {}, "anything.test") is True
    assert ps.name_may_resolve("s", {}, "metadata") is False


def test_request_info_is_frozen_and_decision_is_frozen(rich):
    r = RequestInfo("s", {}, "a.test", 443)
    with pytest.raises(Exception):
        r.host = "b.test"
    d = rich.decide(r)
    with pytest.raises(Exception):
        d.action = "allow"


def test_seed_format(load):
    ps = load("""
    egress: {allowed_domains: [api.openai.com, "*.github.com"], denied_domains: ["*"]}
    """, name="seed.yaml")
    [p] = ps.policies
    assert p.name == "seed" and p.is_default and p.default == "deny"
    assert ps.decide(req("api.openai.com")).action == "allow"
    assert ps.decide(req("x.github.com")).rule == "allowed:*.github.com"
    assert ps.decide(req("github.com")).reason == "default_deny"
    assert ps.decide(req("openai.com")).reason == "default_deny"


def test_seed_format_with_name_applies_to_and_denies(load):
    ps = load("""
    name: legacy
    applies_to: {sandboxes: [sb-9]}
    egress:
      allowed_domains: ["*.corp.test"]
      denied_domains: [secret.corp.test, "*"]
    """)
    assert ps.policy_for("sb-9", {}).name == "legacy"
    assert ps.decide(req("a.corp.test", sb="sb-9")).action == "allow"
    d = ps.decide(req("secret.corp.test", sb="sb-9"))
    assert (d.action, d.reason, d.rule) == ("deny", "rule_deny", "denied:secret.corp.test")
    assert ps.decide(req("a.corp.test", sb="sb-1")).reason == "no_policy"


def test_global_section_in_separate_file(tmp_path):
    from egress.policy import load_policy_dir

    from policy_testlib import write

    write(tmp_path, "a.yaml", "name: a\ndefault: allow\n")
    write(tmp_path, "z-global.yml", "global: {denied_domains: [bad.test], denied_cidrs: [192.0.2.0/24]}\n")
    write(tmp_path, "ignored.txt", "not: [yaml")
    ps = load_policy_dir(tmp_path)
    assert [s.rsplit("/", 1)[1] for s in ps.sources] == ["a.yaml", "z-global.yml"]
    assert ps.decide(req("bad.test")).reason == "global_deny"
    assert ps.decide(req("ok.test")).reason == "default_allow"
    assert ps.decide(req("192.0.2.7", ip=True)).reason == "global_deny"
    cidrs = {str(c) for c in ps.global_denied_cidrs}
    assert {"192.0.2.0/24", "169.254.169.254/32"} <= cidrs
    assert len(ps.digest) == 64


def test_digest_tracks_content(tmp_path):
    from egress.policy import load_policy_dir

    from policy_testlib import write

    write(tmp_path, "a.yaml", "name: a\n")
    d1 = load_policy_dir(tmp_path).digest
    assert load_policy_dir(tmp_path).digest == d1
    write(tmp_path, "a.yaml", "name: a\ndefault: allow\n")
    assert load_policy_dir(tmp_path).digest != d1


def test_decision_cost_does_not_scan_rules(tmp_path):
    """A host under a 20k-rule policy is decided via the trie: only the rules on
    its own label path are touched (checked by counting rule tests)."""
    from egress.policy import CompiledPolicySet, Match, Policy, Rule, parse_host_pattern
    from egress.policy import compiled

    rules = tuple(Rule(f"r{i}", "allow", Match(hosts=(parse_host_pattern(f"h{i}.example.com"),)))
                  for i in range(20_000))
    ps = CompiledPolicySet([Policy("big", rules)])
    calls = 0
    orig = compiled._CRule.test

    def counting(self, *a):
        nonlocal calls
        calls += 1
        return orig(self, *a)

    compiled._CRule.test = counting
    try:
        assert ps.decide(req("h12345.example.com")).rule == "r12345"
        assert ps.decide(req("nope.example.com")).reason == "default_deny"
    finally:
        compiled._CRule.test = orig
    assert calls == 1
