"""The console's pure parts: sessions (fake clock), chart maths, form parsing, exec job bounds."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from cubegate.console import charts, exec_jobs, forms
from httpkit import ApiError, SessionStore


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


# -- sessions ----------------------------------------------------------------------------
def test_sessions_expire_when_idle_and_at_their_maximum_age():
    clock = Clock()
    store = SessionStore(idle_seconds=10, max_age_seconds=25, clock=clock)
    sid, s = store.create("tok1", "admin")
    clock.t += 9
    assert store.get(sid) is s                 # touched: idle clock restarts
    clock.t += 9
    assert store.get(sid, touch=False) is s    # a poll: does not restart it
    clock.t += 1.5
    assert store.get(sid) is None              # 10.5 s since the last real use
    sid, s = store.create("tok1", "admin")
    for _ in range(3):
        clock.t += 8
        assert store.get(sid) is s
    clock.t += 2
    assert store.get(sid) is None              # 26 s after login, however active


def test_session_ids_are_random_stored_hashed_and_bounded():
    store = SessionStore(idle_seconds=60, max_age_seconds=600, max_sessions=3, clock=Clock())
    ids = [store.create(f"t{i}", "read")[0] for i in range(5)]
    assert len(set(ids)) == 5 and all(len(i) >= 43 for i in ids)
    assert len(store) == 3 and store.get(ids[0]) is None and store.get(ids[4]) is not None
    assert not any(i in repr(store._sessions) for i in ids)     # only hashes are kept
    assert store.get("") is None and store.get(None) is None and store.get("x" * 5000) is None


def test_csrf_tokens_are_per_session_and_compared_whole():
    store = SessionStore(idle_seconds=60, max_age_seconds=600, clock=Clock())
    _, a = store.create("t", "admin")
    _, b = store.create("t", "admin")
    assert a.csrf != b.csrf and a.csrf_ok(a.csrf)
    assert not a.csrf_ok(b.csrf) and not a.csrf_ok("") and not a.csrf_ok(None) and not a.csrf_ok(a.csrf[:-1])


def test_end_where_ends_every_session_of_a_token():
    store = SessionStore(idle_seconds=60, max_age_seconds=600, clock=Clock())
    keep, _ = store.create("a", "admin")
    gone = [store.create("b", "admin")[0] for _ in range(2)]
    assert store.end_where(lambda s: s.actor == "b") == 2
    assert store.get(keep) is not None and all(store.get(g) is None for g in gone)


# -- charts ------------------------------------------------------------------------------
def test_quantile_interpolates_inside_a_bucket_like_prometheus():
    buckets = [(0.1, 0.0), (0.5, 50.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert charts.quantile(0.5, buckets) == pytest.approx(0.5)
    assert charts.quantile(0.25, buckets) == pytest.approx(0.3)
    assert charts.quantile(0.99, buckets) == pytest.approx(0.99)
    assert charts.quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert charts.quantile(0.99, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0   # beyond the last finite bound


def _registry():
    r = CollectorRegistry()
    dec = Counter("cubegate_decisions_total", "d", ["sandbox", "action", "reason", "stage"], registry=r)
    nbytes = Counter("cubegate_bytes_total", "b", ["sandbox", "direction"], registry=r)
    starts = Histogram("cubegate_sandbox_start_seconds", "s", ["backend"], buckets=(0.05, 0.1, 0.5, 1.0),
                       registry=r)
    created = Counter("cubegate_sandbox_creations", "c", ["backend", "result"], registry=r)
    return r, dec, nbytes, starts, created


def test_series_from_real_registry_samples():
    r, dec, nbytes, starts, created = _registry()
    ring = charts.Ring(interval=5.0)
    ring.add(charts.sample_from(r.collect(), 100.0))
    dec.labels("sb-1", "allow", "rule_allow", "connect").inc(10)
    dec.labels("sb-2", "allow", "rule_allow", "request").inc(10)
    dec.labels("sb-1", "deny", "no_policy", "connect").inc(5)
    nbytes.labels("sb-1", "in").inc(5000)
    nbytes.labels("sb-1", "out").inc(500)
    for v in (0.06, 0.07, 0.08, 0.3):
        starts.labels("namespace").observe(v)
    created.labels("namespace", "ok").inc(3)
    created.labels("namespace", "error").inc(1)
    ring.add(charts.sample_from(r.collect(), 105.0))
    ring.add(charts.sample_from(r.collect(), 110.0))
    s = charts.series(ring.samples(), top_denied=[("evil.test", 5)])
    assert s["t"] == [105.0, 110.0]
    assert s["decisions"] == {"allow": [4.0, 0.0], "deny": [1.0, 0.0]}
    assert s["bytes"] == {"in": [1000.0, 0.0], "out": [100.0, 0.0]}
    assert s["success_rate"] == [0.75, 0.75]                # trailing minute still holds them
    assert 0.05 < s["start_latency"]["p50"][0] <= 0.1 and 0.1 < s["start_latency"]["p99"][0] <= 0.5
    assert s["window"]["starts"] == 4 and s["window"]["creations"] == 4 and s["window"]["success_rate"] == 0.75
    assert s["top_denied"] == [{"host": "evil.test", "count": 5}]


def test_the_ring_keeps_fifteen_minutes_and_a_minute_trails():
    ring = charts.Ring(interval=5.0)
    r, *_ = _registry()
    for i in range(500):
        ring.add(charts.sample_from(r.collect(), float(i * 5)))
    assert len(ring) == 181 and ring.samples()[0].t == (500 - 181) * 5
    samples = ring.samples()
    assert charts._trailing_base(samples, len(samples) - 1).t == samples[-1].t - 60


def test_counter_resets_are_no_negative_rates():
    a = charts.Sample(0.0, {"allow": 10.0}, {}, (), {})
    b = charts.Sample(5.0, {"allow": 2.0}, {}, (), {})
    assert charts.series([a, b])["decisions"]["allow"] == [0.0]


# -- forms -------------------------------------------------------------------------------
def test_pairs_name_the_line_never_the_value():
    assert forms.pairs("A=1\n\n B = two words \n", "env") == {"A": "1", "B": "two words"}
    with pytest.raises(ApiError) as e:
        forms.pairs("A=1\nsk-secret-looking-value", "env")
    assert e.value.message == "env line 2: expected NAME=VALUE" and "sk-secret" not in e.value.message
    with pytest.raises(ApiError) as e:
        forms.pairs("A=1\nA=sk-other", "env")
    assert "line 2" in e.value.message and "sk-other" not in e.value.message


def test_sandbox_form_becomes_the_api_body():
    doc = forms.sandbox_document({"id": "sb-1", "tenant": "acme", "memory_mb": "128", "cpus": "0.5", "pids": "",
                                  "env": "X=1", "secret_env": "KEY=openai", "labels": "team=a", "backend": ""})
    assert doc == {"id": "sb-1", "tenant": "acme", "labels": {"team": "a"}, "env": {"X": "1"},
                   "secret_env": {"KEY": "openai"}, "limits": {"memory_mb": 128, "cpus": 0.5}}
    with pytest.raises(ApiError, match="memory_mb: must be a whole number"):
        forms.sandbox_document({"memory_mb": "lots"})
    with pytest.raises(ApiError, match="cpus: must be > 0"):
        forms.sandbox_document({"cpus": "-1"})


def test_binding_form_gives_the_clis_options():
    from vault.bindings import doc_from_options
    opts = forms.binding_options({"id": "b", "tenant": "acme", "secret_id": "s", "hosts": "a.test, *.b.test",
                                  "ports": "443 8443", "inject": "basic", "basic_user": "me", "header": "Authorization",
                                  "placeholder": "on"})
    assert doc_from_options(**opts) == {
        "id": "b", "tenant": "acme", "secret_id": "s", "placeholder": True,
        "match": {"hosts": ["a.test", "*.b.test"], "ports": [443, 8443], "allow_plaintext": False},
        "inject": {"type": "basic", "username": "me"}}
    with pytest.raises(ApiError):
        forms.binding_options({"inject": "cookie"})
    with pytest.raises(ValueError, match="exactly one"):
        doc_from_options(**forms.binding_options({"inject": "query", "query": ""}))


# -- exec jobs ---------------------------------------------------------------------------
def test_exec_job_output_is_bounded_and_utf8_split_safe():
    async def main():
        jobs = exec_jobs.ExecJobs(lambda e: "failed")
        gate = asyncio.Event()

        async def run(job):
            job.output_hook("stdout", "é".encode()[:1])         # half a character
            job.output_hook("stdout", "é".encode()[1:] + b"\n")
            job.output_hook("stderr", b"x" * (exec_jobs.MAX_OUTPUT + 10))
            job.output_hook("stdout", b"after the cap")
            await gate.wait()
            return {"exit_code": 0, "timed_out": False, "duration_s": 0.1}
        job = jobs.start("sb-1", "owner-a", run)
        await asyncio.sleep(0.05)
        assert job.text("stdout") == "é\n" and job.truncated and job.size <= exec_jobs.MAX_OUTPUT + len(exec_jobs.TRUNCATED)
        assert jobs.get(job.id, "owner-b") is None and jobs.get(job.id, "owner-a") is job
        gate.set()
        await job.task
        assert job.done and job.result["exit_code"] == 0 and "after the cap" not in job.text()

        async def boom(job):
            raise RuntimeError("internal detail /etc/x")
        bad = jobs.start("sb-1", "owner-a", boom)
        await bad.task
        assert bad.error == "failed"
    asyncio.run(main())
