"""Per route (and per upstream): headers set or removed on the way upstream, with values from the
environment or a file read at start-up, and a route's own `upstream_timeout` (SPEC §10, §12)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from idemproxy.config.settings import load_settings
from idemproxy.core.types import JobState
from idemproxy.proxy.routing import RouteTable
from idemproxy.proxy.upstream.client import UpstreamClient
from idemproxy.store.base import Store
from tests.support.proxychecks import KEY, assert_problem, only_job

from .conftest import ProxyFactory
from .upstream_leg import Upstream

SECRET = "sk-test-5f1e0c9b"
SINGLE_SPACES = "may follow words separated by single spaces"
SET_X = {"set": {"x-request-key": "proxy-wide-key"}}
REMOVE_X = {"remove": ["X-Request-Key"]}


def route(url: str, **options: Any) -> dict[str, Any]:
    return {"routes": [{"prefix": "/", "upstream": url, **options}]}


async def test_headers_are_set_from_env_and_file_and_removed(
    proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PROVIDER_KEY", SECRET)
    (tmp_path / "org").write_text("org-42\n")  # as `echo` writes a secret file
    headers = {
        "set": {
            "Authorization": "Bearer env:PROVIDER_KEY",
            "X-Org": f"file:{tmp_path / 'org'}",
            "X-Plain": "1",
        },
        "remove": ["Cookie", "authorization"],
    }
    async with Upstream() as upstream:
        client = await proxy(**route(upstream.url, upstream_headers=headers))
        sent = {KEY: "k1", "Authorization": "Bearer client-token", "Cookie": "a=1"}
        response = await client.post("/pay", json={"a": 1}, headers=sent)
        assert response.status == 201, await response.text()
        passthrough = await client.get("/models", headers={"Cookie": "a=1"})
        assert passthrough.status == 201
    for seen in upstream.headers:  # governed and passed through alike
        assert seen.getall("Authorization") == [f"Bearer {SECRET}"]
        assert seen["X-Org"] == "org-42"
        assert seen["X-Plain"] == "1"
        assert "Cookie" not in seen


async def test_owner_fingerprint_logs_and_store_never_see_a_set_header(
    proxy: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
    jobs: Store,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same request through a route that sets the provider key and through one that does
    not: one owner, one fingerprint (taken from the client's request before the edits), and
    the key in no log line, stored field or setting's repr."""
    monkeypatch.setenv("PROVIDER_KEY", SECRET)
    headers = {"set": {"Authorization": "env:PROVIDER_KEY", "Content-Type": "text/plain"}}
    caplog.set_level(logging.DEBUG)
    async with Upstream() as upstream:
        plain = await proxy(**route(upstream.url))
        keyed = await proxy(**route(upstream.url, upstream_headers=headers))
        for key, client in (("plain", plain), ("keyed", keyed)):
            sent = {KEY: key, "Authorization": "Bearer client-token"}
            response = await client.post("/pay", json={"a": 1}, headers=sent)
            assert response.status == 201, await response.text()
    assert [h["Authorization"] for h in upstream.headers] == ["Bearer client-token", SECRET]
    listed = [await jobs.get_by_id(job.id) for job in await jobs.list_jobs()]
    assert len(listed) == 2
    assert listed[0] is not None and listed[1] is not None
    assert listed[0].owner == listed[1].owner
    assert listed[0].fingerprint == listed[1].fingerprint
    assert SECRET not in caplog.text
    assert all(SECRET not in repr(job) for job in listed)  # its stored response included
    settings = load_settings(**route(upstream.url, upstream_headers=headers))
    assert SECRET not in repr(settings)
    assert SECRET not in repr(RouteTable.from_settings(settings).routes)


async def test_each_upstream_of_a_group_gets_its_own_key(
    proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch, jobs: Store
) -> None:
    """Fail-over between two providers: the primary's release status (503) moves the job to
    the fallback, and each was sent its own key, after the route's common headers."""
    monkeypatch.setenv("PRIMARY_KEY", "key-primary")
    monkeypatch.setenv("FALLBACK_KEY", "key-fallback")
    async with Upstream(status=503) as primary, Upstream() as fallback:
        client = await proxy(
            routes=[
                {
                    "prefix": "/",
                    "upstream": primary.url,
                    "fallbacks": [fallback.url],
                    "upstream_headers": {"set": {"X-Api-Key": "none", "X-Via": "gateway"}},
                }
            ],
            upstreams={
                primary.url: {"headers": {"set": {"X-Api-Key": "env:PRIMARY_KEY"}}},
                fallback.url: {"headers": {"set": {"X-Api-Key": "env:FALLBACK_KEY"}}},
            },
        )
        response = await client.post("/pay", json={"a": 1}, headers={KEY: "k1"})
        assert response.status == 201, await response.text()
    assert [h["X-Api-Key"] for h in primary.headers] == ["key-primary"]
    assert [h["X-Api-Key"] for h in fallback.headers] == ["key-fallback"]
    assert fallback.headers[0]["X-Via"] == "gateway"
    assert (await only_job(jobs)).state is JobState.COMPLETED


async def test_a_routes_upstream_timeout_overrides_the_global_one(
    proxy: ProxyFactory, jobs: Store
) -> None:
    async with Upstream(delay=0.6) as slow:
        client = await proxy(
            upstream_timeout=5,
            routes=[
                {"prefix": "/short", "upstream": slow.url, "upstream_timeout": 0.2},
                {"prefix": "/", "upstream": slow.url},
            ],
        )
        short = await client.post("/short", json={}, headers={KEY: "k1"})
        await assert_problem(short, "upstream-timeout", 504)
        assert (await only_job(jobs)).state is JobState.UNKNOWN
        passed_through = await client.get("/short")
        await assert_problem(passed_through, "upstream-timeout", 504)
        assert (await client.post("/long", json={}, headers={KEY: "k2"})).status == 201


def test_a_duplicate_waits_as_long_as_its_routes_attempt_may_take() -> None:
    settings = load_settings(
        upstream_timeout=30,
        routes=[
            {"prefix": "/slow", "upstream": "http://a:1", "upstream_timeout": 120},
            {"prefix": "/", "upstream": "http://a:1"},
        ],
    )
    slow, default = (RouteTable.from_settings(settings).find(p, None) for p in ("/slow", "/"))
    assert slow is not None and default is not None
    assert (slow.max_wait, default.max_wait) == (125, 35)
    assert slow.upstream_timeout == 120 and default.upstream_timeout is None
    fixed = load_settings(max_wait=7, **route("http://a:1", upstream_timeout=120))
    assert RouteTable.from_settings(fixed).routes[0].max_wait == 7


OWNED = "framed, answered or set by the proxy itself"


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"set": {"X-Key": "env:IDEMPROXY_TEST_UNSET"}}, "IDEMPROXY_TEST_UNSET is not set"),
        ({"set": {"X-Key": "file:/nonexistent/key"}}, "cannot read /nonexistent/key"),
        ({"set": {"Host": "a"}}, OWNED),
        ({"set": {"Bad Name": "a"}}, "is not a header name"),
        ({"remove": ["Content-Length"]}, OWNED),
        ({"set": {"X-Key": "line\nbreak"}}, "not a header value"),
        ({"set": {"Expect": "100-continue"}}, OWNED),
        ({"set": {"idempotency-job": "0" * 32}}, OWNED),
        ({"set": {"Idempotency-Attempt": "2"}}, OWNED),
        ({"remove": ["Idempotency-Attempt"]}, OWNED),
        ({"set": {"Idempotent-Replayed": "?1"}}, OWNED),
        ({"set": {"Idempotency-Error": "x"}}, OWNED),
        ({"set": {"Proxy-Authorization": "Basic eDp5"}}, OWNED),
        ({"remove": ["TE"]}, OWNED),
        ({"set": {"Keep-Alive": "timeout=5"}}, OWNED),
        ({"set": {"Idempotency-Key": "proxy-wide-key"}}, OWNED),
        ({"remove": ["idempotency-key"]}, OWNED),
        ({"set": {"X-A": "Bearer  file:/run/key"}}, SINGLE_SPACES),
        ({"set": {"X-A": "Bearer\tenv:KEY"}}, SINGLE_SPACES),
        ({"set": {"X-A": " file:/run/key"}}, SINGLE_SPACES),
        ({"set": {"X-A": "Bearer env: KEY"}}, SINGLE_SPACES),
    ],
    ids=[
        "env",
        "file",
        "host",
        "name",
        "framing",
        "line-break",
        "expect",
        "job",
        "attempt",
        "remove-attempt",
        "replayed",
        "error",
        "proxy-authorization",
        "te",
        "keep-alive",
        "idempotency-key",
        "remove-idempotency-key",
        "two-spaces",
        "tab",
        "leading-space",
        "nothing-after-the-colon",
    ],
)
def test_unusable_header_settings_stop_the_start(headers: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as raised:
        load_settings(**route("http://a:1", upstream_headers=headers))
    (error,) = raised.value.errors()
    assert error["loc"][:3] == ("routes", 0, "upstream_headers"), error
    assert message in error["msg"], error


@pytest.mark.parametrize(
    ("settings", "refused"),
    [
        (
            {"key_header": "X-Request-Key", **route("http://a:1", upstream_headers=SET_X)},
            "routes[0].upstream_headers: x-request-key is the idempotency key header (key_header)",
        ),
        (
            {
                "routes": [
                    {"prefix": "/o", "upstream": "http://a:1", "key": {"header": "X-Request-Key"}},
                    {"prefix": "/", "upstream": "http://a:1", "upstream_headers": REMOVE_X},
                ]
            },
            "routes[1].upstream_headers: X-Request-Key is the idempotency key header"
            " (routes[0].key.header)",
        ),
        (
            {
                "key_header": "X-Request-Key",
                **route("http://a:1"),
                "upstreams": {"http://a:1": {"headers": SET_X}},
            },
            "upstreams.http://a:1.headers: x-request-key is the idempotency key header"
            " (key_header)",
        ),
    ],
    ids=["key-header", "a-routes-key-header", "per-upstream"],
)
def test_no_route_changes_an_idempotency_key_header_upstream(
    settings: dict[str, Any], refused: str
) -> None:
    """SPEC §10: one key set upstream for every client makes their requests collide at a
    backend that deduplicates on it (bob would get alice's response)."""
    with pytest.raises(ValidationError) as raised:
        load_settings(**settings)
    assert refused in str(raised.value), raised.value


def test_a_secret_read_is_never_in_the_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PROVIDER_KEY", f"{SECRET}\r\nX-Injected: 1")
    with pytest.raises(ValidationError) as raised:
        load_settings(**route("http://a:1", upstream_headers={"set": {"K": "env:PROVIDER_KEY"}}))
    assert "env:PROVIDER_KEY" in str(raised.value)
    assert SECRET not in str(raised.value)


async def test_contract_samples_are_sent_with_the_headers_set_upstream(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fallback checked against its contract (SPEC §3.4) gets its key as requests do, or a
    provider would answer every sample 401 and never be eligible."""
    monkeypatch.setenv("FALLBACK_KEY", SECRET)
    schema, samples = tmp_path / "schema.json", tmp_path / "samples.jsonl"
    schema.write_text('{"type": "object", "required": ["executed"]}')
    samples.write_text('{"method": "POST", "path": "/pay", "headers": {"X-Sample": "1"}}\n')
    async with Upstream() as primary, Upstream() as fallback:
        settings = load_settings(
            routes=[
                {
                    "prefix": "/",
                    "upstream": primary.url,
                    "fallbacks": [fallback.url],
                    "contract": {"schema_file": str(schema), "samples_file": str(samples)},
                }
            ],
            upstreams={fallback.url: {"headers": {"set": {"Authorization": "env:FALLBACK_KEY"}}}},
        )
        (route,) = RouteTable.from_settings(settings).routes
        assert route.gate is not None
        client = UpstreamClient(timeout=2, connect_timeout=2, connections=2, keepalive=5)
        await client.open()
        try:
            await route.gate.check(client)
        finally:
            await client.close()
    assert route.gate.eligible == (fallback.url,)
    (seen,) = fallback.headers
    assert (seen["Authorization"], seen["X-Sample"]) == (SECRET, "1")


async def test_contract_samples_wait_the_routes_upstream_timeout(tmp_path: Path) -> None:
    """A route whose backend is slower than the global `upstream_timeout` says so with its own;
    its samples must wait that long too, or a fallback that answers every request in time
    would fail every check (SPEC §3.4, §10)."""
    schema, samples = tmp_path / "schema.json", tmp_path / "samples.jsonl"
    schema.write_text('{"type": "object", "required": ["executed"]}')
    samples.write_text('{"method": "POST", "path": "/pay"}\n')
    async with Upstream() as primary, Upstream(delay=1.0) as fallback:
        settings = load_settings(
            upstream_timeout=0.3,
            routes=[
                {
                    "prefix": "/slow",
                    "upstream": primary.url,
                    "fallbacks": [fallback.url],
                    "upstream_timeout": 10,
                    "contract": {"schema_file": str(schema), "samples_file": str(samples)},
                },
                {
                    "prefix": "/",
                    "upstream": primary.url,
                    "fallbacks": [fallback.url],
                    "contract": {"schema_file": str(schema), "samples_file": str(samples)},
                },
            ],
        )
        slow, default = (RouteTable.from_settings(settings).find(p, None) for p in ("/slow", "/"))
        assert slow is not None and slow.gate is not None
        assert default is not None and default.gate is not None
        client = UpstreamClient(
            timeout=settings.upstream_timeout, connect_timeout=2, connections=2, keepalive=5
        )
        await client.open()
        try:
            await slow.gate.check(client)
            await default.gate.check(client)
        finally:
            await client.close()
    assert slow.gate.eligible == (fallback.url,), slow.gate.reports
    # The global timeout still applies to a route without its own.
    assert default.gate.eligible == (), default.gate.reports
