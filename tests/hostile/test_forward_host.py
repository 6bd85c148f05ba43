"""SPEC §10 `forward_host`: the Host the backend receives, and the Host shapes refused (400).

Before, the backend always got `Host: 127.0.0.1:<port>` (the upstream's authority) and the
client's only in X-Forwarded-Host: Django's ALLOWED_HOSTS answered 400 to every proxied request,
absolute URLs and redirects named the backend's private address, a SigV4 signature (which signs
the Host) never matched. The upstream records the bytes it received; the client writes raw bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.support.recording_upstream import RecordingUpstream

from .conftest import CountingStore, ListeningProxy
from .test_identity import exchange


@pytest.fixture
async def recorder() -> AsyncIterator[RecordingUpstream]:
    async with RecordingUpstream() as upstream:
        yield upstream


def request(
    host_lines: bytes, method: str = "POST", target: str = "/orders", key: str = ""
) -> bytes:
    return (
        f"{method} {target} HTTP/1.1\r\n".encode()
        + host_lines
        + (f"Idempotency-Key: {key}\r\n".encode() if key else b"")
        + b"Content-Length: 3\r\nConnection: close\r\n\r\npay"
    )


async def start(
    listening_proxy: ListeningProxy,
    counting_store: CountingStore,
    recorder: RecordingUpstream,
    **settings: Any,
) -> tuple[str, int]:
    return await listening_proxy(inject_store=counting_store, upstream=recorder.url, **settings)


@pytest.mark.parametrize("host", ["api.example.com", "API.Example.COM.:8443", "[2001:db8::7]:80"])
async def test_by_default_an_http_backend_receives_the_clients_host_byte_for_byte(
    listening_proxy: ListeningProxy,
    counting_store: CountingStore,
    recorder: RecordingUpstream,
    host: str,
) -> None:
    address = await start(listening_proxy, counting_store, recorder)
    for method, key in (("GET", ""), ("POST", ""), ("POST", "k-host")):
        answer = await exchange(address, request(f"Host: {host}\r\n".encode(), method, key=key))
        assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    for received in recorder.received:
        assert received.header_lines("Host") == [host.encode()]
        assert received.header_lines("X-Forwarded-Host") == [host.encode()]
        quoted = host if ":" not in host else f'"{host}"'
        assert received.header_lines("Forwarded") == [
            f"for=127.0.0.1;host={quoted};proto=http".encode()
        ]


async def test_a_replay_is_answered_without_a_second_request_whatever_the_host(
    listening_proxy: ListeningProxy, counting_store: CountingStore, recorder: RecordingUpstream
) -> None:
    """SPEC §6: Host is not part of the fingerprint; a retry through another name of the same
    service (its load balancer's, another case) is the same request, replayed."""
    address = await start(listening_proxy, counting_store, recorder)
    first = await exchange(address, request(b"Host: api.example.com\r\n", key="k-replay"))
    again = await exchange(address, request(b"Host: API.example.com.\r\n", key="k-replay"))
    assert first.startswith(b"HTTP/1.1 201 ") and again.startswith(b"HTTP/1.1 201 ")
    assert b"Idempotent-Replayed: true\r\n" in again
    assert recorder.one.header_lines("Host") == [b"api.example.com"]


@pytest.mark.parametrize(
    ("setting", "expected"),
    [("upstream", None), ("client", b"api.example.com"), ("backend.internal:8080", None)],
)
async def test_the_top_level_forward_host_applies_to_the_upstream_route(
    listening_proxy: ListeningProxy,
    counting_store: CountingStore,
    recorder: RecordingUpstream,
    setting: str,
    expected: bytes | None,
) -> None:
    address = await start(listening_proxy, counting_store, recorder, forward_host=setting)
    answer = await exchange(address, request(b"Host: api.example.com\r\n", key="k"))
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    authority = recorder.url.removeprefix("http://").encode()
    fixed = setting.encode() if setting not in ("upstream", "client") else authority
    assert recorder.one.header_lines("Host") == [expected or fixed]
    # The client's Host still reaches the backend beside it, as before.
    assert recorder.one.header_lines("X-Forwarded-Host") == [b"api.example.com"]


async def test_forward_host_is_chosen_per_route(
    listening_proxy: ListeningProxy, counting_store: CountingStore, recorder: RecordingUpstream
) -> None:
    routes = [
        {"prefix": "/a", "upstream": recorder.url, "forward_host": "upstream"},
        {"prefix": "/b", "upstream": recorder.url, "forward_host": "b.internal"},
        {"prefix": "/c", "upstream": recorder.url},  # auto: client, for an http:// upstream
    ]
    address = await start(listening_proxy, counting_store, recorder, routes=routes)
    for target in ("/a/x", "/b/x", "/c/x"):
        answer = await exchange(address, request(b"Host: api.example.com\r\n", target=target))
        assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    authority = recorder.url.removeprefix("http://").encode()
    hosts = [r.header_lines("Host") for r in recorder.received]
    assert hosts == [[authority], [b"b.internal"], [b"api.example.com"]]


async def test_an_http_1_0_request_without_host_gets_the_upstreams(
    listening_proxy: ListeningProxy, counting_store: CountingStore, recorder: RecordingUpstream
) -> None:
    """HTTP/1.0 may omit Host (aiohttp refuses an HTTP/1.1 request without one): there is no
    client's Host to keep, and HTTP/1.1 to the backend needs one."""
    address = await start(listening_proxy, counting_store, recorder)
    answer = await exchange(address, b"POST /x HTTP/1.0\r\nContent-Length: 3\r\n\r\npay")
    assert answer.startswith(b"HTTP/1.1 201 ") or answer.startswith(b"HTTP/1.0 201 "), answer
    assert recorder.one.header_lines("Host") == [recorder.url.removeprefix("http://").encode()]
    # SPEC §10: those carry the client's Host, and it sent none: not the proxy's own address.
    assert recorder.one.header_lines("X-Forwarded-Host") == []
    assert b"host=" not in b"".join(recorder.one.header_lines("Forwarded"))


async def test_an_absolute_form_target_agreeing_with_host_keeps_the_clients_host(
    listening_proxy: ListeningProxy, counting_store: CountingStore, recorder: RecordingUpstream
) -> None:
    address = await start(listening_proxy, counting_store, recorder)
    sent = request(b"Host: api.example.com\r\n", target="http://API.example.com:80/x?y")
    answer = await exchange(address, sent)
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    assert recorder.one.target == b"/x?y"
    assert recorder.one.header_lines("Host") == [b"api.example.com"]


# Each would leave the backend a Host other than the one the proxy routed by, or several to
# choose from: 400 (RFC 9112 §3.2, §3.2.2; RFC 9110 §4.2.1, §4.2.4), nothing forwarded.
HOSTILE = {
    "two-lines": b"Host: api.example.com\r\nHost: evil.example\r\n",
    "two-lines-same": b"Host: api.example.com\r\nhost: api.example.com\r\n",
    "list": b"Host: api.example.com, evil.example\r\n",
    "list-no-space": b"Host: api.example.com,evil.example\r\n",
    "empty": b"Host: \r\n",
    "userinfo": b"Host: user@api.example.com\r\n",
    "userinfo-evil": b"Host: api.example.com@evil.example\r\n",
    "inner-space": b"Host: api.example.com evil.example\r\n",
    "inner-tab": b"Host: api.example.com\tevil.example\r\n",
    "path": b"Host: api.example.com/evil\r\n",
    "folded": b"Host: api.example.com\r\n evil.example\r\n",
    "space-before-colon": b"Host : evil.example\r\nHost: api.example.com\r\n",
    "port-only": b"Host: :8080\r\n",
    "two-ports": b"Host: api.example.com:80:81\r\n",
    "non-ascii": "Host: äpi.example.com\r\n".encode(),
    "nul": b"Host: api.example.com\x00.evil\r\n",
}


@pytest.mark.parametrize("host_lines", HOSTILE.values(), ids=HOSTILE.keys())
async def test_a_hostile_host_is_400_and_reaches_no_backend(
    listening_proxy: ListeningProxy,
    counting_store: CountingStore,
    recorder: RecordingUpstream,
    host_lines: bytes,
) -> None:
    address = await start(listening_proxy, counting_store, recorder)
    for method, key in (("GET", ""), ("POST", "k-hostile")):
        answer = await exchange(address, request(host_lines, method, key=key))
        assert answer.split(b" ", 2)[1] == b"400", (host_lines, answer[:300])
    assert recorder.received == []
    assert counting_store.calls == []


HOSTILE_TARGETS = {
    "other-host": "http://evil.example/orders",
    "other-port": "http://api.example.com:8080/orders",
    "https-default-port": "https://api.example.com/orders",  # 443 is not Host's 80
    "userinfo": "http://user@api.example.com/orders",
    "userinfo-evil": "http://api.example.com@evil.example/orders",
    "other-scheme": "ftp://api.example.com/orders",
    "no-authority": "http:///orders",
}


@pytest.mark.parametrize("target", HOSTILE_TARGETS.values(), ids=HOSTILE_TARGETS.keys())
async def test_an_absolute_form_target_disagreeing_with_host_is_400(
    listening_proxy: ListeningProxy,
    counting_store: CountingStore,
    recorder: RecordingUpstream,
    target: str,
) -> None:
    """RFC 9112 §3.2.2 has a server take the target's authority over Host; the backend gets
    origin-form and a Host only: two names would leave it and the routing one each."""
    address = await start(listening_proxy, counting_store, recorder)
    for key in ("", "k-absolute"):
        sent = request(b"Host: api.example.com:80\r\n", target=target, key=key)
        answer = await exchange(address, sent)
        assert answer.split(b" ", 2)[1] == b"400", (target, answer[:300])
    assert recorder.received == []
    assert counting_store.calls == []


@pytest.mark.parametrize(
    ("target", "sent"), [("http://api.example.com", b"/"), ("http://api.example.com?x=/", b"/?x=/")]
)
async def test_an_absolute_form_target_without_a_path_asks_for_the_root(
    listening_proxy: ListeningProxy,
    counting_store: CountingStore,
    recorder: RecordingUpstream,
    target: str,
    sent: bytes,
) -> None:
    """RFC 9112 §3.2.1: the empty path of an absolute-form target is `/` (it was a 404)."""
    address = await start(listening_proxy, counting_store, recorder)
    answer = await exchange(address, request(b"Host: api.example.com\r\n", target=target, key="k"))
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    assert recorder.one.target == sent
    assert recorder.one.header_lines("Host") == [b"api.example.com"]
