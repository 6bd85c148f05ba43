"""Header bytes from an upstream reach the client as they were sent (SPEC §7, §10).

RFC 9110 §5.5 lets a field value hold obs-text (0x80-0xFF): an ISO-8859-1 servlet container
answers `X-Name: caf\\xe9`. Every path a response takes is tried here, on every store a proxy
serves from: pass-through (whole and streamed), the first answer of a governed request (whole
and streamed) and its replays (from the store, the in-process cache and Redis). The upstream is
a bare socket that sends exact bytes, and the client reads the proxy's answer off a bare socket
too (aiohttp's client would decode it). A value with another control character is left out
(SPEC §10), and one with NUL is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from idemproxy.constants import ATTEMPT_HEADER, JOB_HEADER, REPLAY_OMITTED_HEADER, REPLAYED_HEADER
from idemproxy.core.types import JobState
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.context import CONTEXT
from tests.support.keyring import key_entry

from .conftest import ProxyFactory, RawUpstream

Fields = list[tuple[bytes, bytes]]
_keys = itertools.count()
# Added by the proxy on every answer (or recomputed by it): not the upstream's to compare.
_PROXY_ADDED = frozenset(
    name.lower().encode()
    for name in (
        "Date",
        "Server",
        "Content-Length",
        "Transfer-Encoding",
        "Connection",
        JOB_HEADER,
        ATTEMPT_HEADER,
        REPLAYED_HEADER,
        REPLAY_OMITTED_HEADER,
    )
)


@dataclass
class Answer:
    status_line: bytes
    fields: Fields
    body: bytes

    @property
    def status(self) -> int:
        return int(self.status_line.split(b" ")[1])

    def upstream_fields(self) -> Fields:
        return [(n, v) for n, v in self.fields if n.lower() not in _PROXY_ADDED]

    def get(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.fields if n.lower() == name.lower()), None)


def upstream_answer(fields: Fields, body: bytes, *, chunked: bool = False) -> bytes:
    """A response as exact bytes; a chunked one makes the pass-through stream it."""
    head = [b"HTTP/1.1 200 OK", *(n + b": " + v for n, v in fields), b"Connection: close"]
    if chunked:
        head.append(b"Transfer-Encoding: chunked")
        framed = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    else:
        head.append(b"Content-Length: %d" % len(body))
        framed = body
    return b"\r\n".join(head) + b"\r\n\r\n" + framed


def _dechunk(data: bytes) -> bytes:
    body = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return body
        body, data = body + data[:size], data[size + 2 :]


async def exchange(client: TestClient[Any, Any], request: bytes) -> Answer:
    """Exact request bytes (with `Connection: close`) to the proxy, its answer as bytes."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(request)
        data = await asyncio.wait_for(reader.read(), timeout=5)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    assert data, "the proxy closed the connection without an answer"
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *lines = head.split(b"\r\n")
    fields: Fields = []
    for line in lines:
        name, sep, value = line.partition(b": ")
        assert sep, line
        fields.append((name, value))
    answer = Answer(status_line, fields, rest)
    if (answer.get(b"Transfer-Encoding") or b"").lower() == b"chunked":
        answer.body = _dechunk(rest)
    return answer


def post(body: bytes, key: str | None = None, method: bytes = b"POST") -> bytes:
    head = [method + b" /payments HTTP/1.1", b"Host: proxy", b"Connection: close"]
    head.append(b"Content-Length: %d" % len(body))
    if key is not None:
        head.append(b"Idempotency-Key: " + key.encode())
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def new_key() -> str:
    return f"k-{next(_keys)}-{time.monotonic_ns()}"


# --- the stores -----------------------------------------------------------------------------


class RedisProcess:
    """A `redis-server` of this test's own on a free loopback port (the shared one untouched)."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(workdir)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not self._answers():
            assert self.proc.poll() is None and time.monotonic() < deadline, "no redis-server"
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    server = RedisProcess(tmp_path)
    try:
        yield server.url
    finally:
        server.stop()


# SQLite; PostgreSQL alone; PostgreSQL behind the in-process replay cache (what `serve` builds
# by default); PostgreSQL behind Redis.
STORES = [
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("postgres+memory", marks=pytest.mark.postgres),
    pytest.param("postgres+redis", marks=pytest.mark.postgres),
]


@pytest.fixture(params=STORES)
def store_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The proxy's settings for the store `request.param` names (one of STORES)."""
    kind: str = request.param
    if kind == "sqlite":
        return {"store": request.getfixturevalue("sqlite_dsn")}
    options: dict[str, Any] = {"store": request.getfixturevalue("pg_dsn")}
    if kind != "postgres+memory":
        options["replay_cache"] = {"max_bytes": 0}
    if kind == "postgres+redis":
        options["redis"] = request.getfixturevalue("redis_url")
    return options


@pytest.fixture
async def client(
    store_options: dict[str, Any], make_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> TestClient[Any, Any]:
    return await make_proxy(upstream=raw_upstream.url, **store_options)


async def first_and_replays(
    client: TestClient[Any, Any], upstream: RawUpstream, body: bytes = b"pay"
) -> list[Answer]:
    """The first answer of a governed request, then two replays (the second from a cache,
    where the store has one)."""
    key = new_key()
    first = await exchange(client, post(body, key))
    sent = len(upstream.heads)
    replays = [await exchange(client, post(body, key)) for _ in range(2)]
    assert len(upstream.heads) == sent, "a replay went upstream"
    for replay in replays:
        assert replay.get(b"Idempotent-Replayed") == b"true", replay
    return [first, *replays]


OBS_TEXT: Fields = [
    (b"Content-Type", b"text/plain; charset=iso-8859-1"),
    (b"X-Name", b"caf\xe9"),
    (b"X-Mixed", b"\xc3\xa9t\xe9 \xff\x80\tend"),  # UTF-8, then bytes that are not
    (b"X-Utf8", "naïve ☃".encode()),
]


# --- obs-text passes byte for byte (defect 2) -----------------------------------------------


async def test_obs_text_reaches_the_client_on_the_first_answer_and_every_replay(
    client: TestClient[Any, Any], raw_upstream: RawUpstream
) -> None:
    raw_upstream.response = upstream_answer(OBS_TEXT, b"caf\xe9 ok")
    for answer in await first_and_replays(client, raw_upstream):
        assert answer.status == 200, answer
        assert answer.upstream_fields() == OBS_TEXT
        assert answer.body == b"caf\xe9 ok"


async def test_obs_text_is_stored_as_sent(
    client: TestClient[Any, Any], raw_upstream: RawUpstream
) -> None:
    raw_upstream.response = upstream_answer(OBS_TEXT, b"ok")
    key = new_key()
    assert (await exchange(client, post(b"pay", key))).status == 200
    store = client.app[CONTEXT].store
    job = await store.get("anonymous", key)
    assert job is not None and job.state is JobState.COMPLETED and job.response is not None
    stored = [
        (name.encode(), value.encode("utf-8", "surrogateescape"))
        for name, value in job.response.headers
    ]
    assert stored == OBS_TEXT


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "streamed"])
async def test_obs_text_passes_through(
    client: TestClient[Any, Any], raw_upstream: RawUpstream, chunked: bool
) -> None:
    raw_upstream.response = upstream_answer(OBS_TEXT, b"\xe9" * 3, chunked=chunked)
    answer = await exchange(client, post(b"pay"))  # no key: not governed
    assert answer.status == 200, answer
    assert answer.upstream_fields() == OBS_TEXT
    assert answer.body == b"\xe9" * 3


@pytest.mark.parametrize("store_options", ["sqlite"], indirect=True)
async def test_obs_text_in_a_head_only_answer(
    client: TestClient[Any, Any], raw_upstream: RawUpstream
) -> None:
    """A HEAD answer goes aiohttp's own way (no one-write path): the same bytes."""
    raw_upstream.response = upstream_answer(OBS_TEXT, b"")
    answer = await exchange(client, post(b"", method=b"HEAD"))
    assert answer.status == 200, answer
    assert answer.upstream_fields() == OBS_TEXT


async def test_obs_text_on_a_streamed_first_answer_and_its_replay(
    store_options: dict[str, Any], make_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    """A body over max_stored_body streams to the first client and is not kept (SPEC §7)."""
    options = {**store_options, "max_stored_body": 16}
    client = await make_proxy(upstream=raw_upstream.url, **options)
    raw_upstream.response = upstream_answer(OBS_TEXT, b"\xe9" * 100)
    first, *replays = await first_and_replays(client, raw_upstream)
    assert (first.status, first.upstream_fields(), first.body) == (200, OBS_TEXT, b"\xe9" * 100)
    for replay in replays:
        assert replay.upstream_fields() == OBS_TEXT
        assert replay.get(REPLAY_OMITTED_HEADER.encode()) == b"omitted"


# --- control characters (SPEC §10) ----------------------------------------------------------


@pytest.mark.parametrize("store_options", ["sqlite", "postgres"], indirect=True)
async def test_a_field_with_a_control_character_is_left_out_and_counted(
    client: TestClient[Any, Any], raw_upstream: RawUpstream
) -> None:
    controls = [(b"X-Ctl-%d" % c, b"a" + bytes([c]) + b"b") for c in (1, 8, 0x0B, 0x1F, 0x7F)]
    fields = [*OBS_TEXT[:2], *controls, (b"X-Tab", b"a\tb")]
    raw_upstream.response = upstream_answer(fields, b"done")
    kept = [*OBS_TEXT[:2], (b"X-Tab", b"a\tb")]
    for answer in await first_and_replays(client, raw_upstream):
        assert (answer.status, answer.upstream_fields(), answer.body) == (200, kept, b"done")
    passed = await exchange(client, post(b"pay"))
    assert (passed.status, passed.upstream_fields()) == (200, kept)
    metrics: Metrics = client.app[CONTEXT].metrics
    dropped = metrics.registry.get_sample_value("idemproxy_upstream_headers_dropped_total")
    assert dropped == 2 * len(controls)  # the governed first answer and the pass-through


@pytest.mark.parametrize("store_options", ["sqlite"], indirect=True)
async def test_a_reason_phrase_with_a_control_character_is_not_forwarded(
    client: TestClient[Any, Any], raw_upstream: RawUpstream
) -> None:
    raw_upstream.response = upstream_answer(OBS_TEXT, b"ok").replace(b" OK", b" O\x01K", 1)
    answer = await exchange(client, post(b"pay"))
    assert answer.status_line == b"HTTP/1.1 200 "
    assert answer.upstream_fields() == OBS_TEXT
    raw_upstream.response = upstream_answer(OBS_TEXT, b"ok").replace(b" OK", b" Tr\xe8s bien", 1)
    assert (await exchange(client, post(b"pay"))).status_line == b"HTTP/1.1 200 Tr\xe8s bien"


# --- the status line: a replay's is the first answer's (SPEC §7) -----------------------------

# Another phrase than the standard one, obs-text, UTF-8, an empty one, a status without a
# standard phrase, and the standard phrase itself (stored as nothing).
STATUS_LINES = [
    b"201 Made Fresh",
    b"200 Tr\xe8s bien",
    "201 Créé ✓".encode(),
    b"201 ",
    b"299 Custom",
    b"299 ",
    b"200 OK",
]


@pytest.mark.parametrize("status_line", STATUS_LINES)
async def test_every_replay_s_status_line_is_the_first_answer_s(
    client: TestClient[Any, Any], raw_upstream: RawUpstream, status_line: bytes
) -> None:
    raw_upstream.response = upstream_answer(OBS_TEXT, b"ok").replace(b"200 OK", status_line, 1)
    answers = await first_and_replays(client, raw_upstream)
    assert [answer.status_line for answer in answers] == [b"HTTP/1.1 " + status_line] * 3
    for answer in answers:
        assert (answer.upstream_fields(), answer.body) == (OBS_TEXT, b"ok")


@pytest.mark.parametrize("store_options", ["sqlite", "postgres+redis"], indirect=True)
@pytest.mark.parametrize("size", [16 * 1024, 200 * 1024], ids=["one-write", "shared"])
async def test_the_status_line_of_a_large_or_streamed_first_answer_is_replayed(
    store_options: dict[str, Any], make_proxy: ProxyFactory, raw_upstream: RawUpstream, size: int
) -> None:
    """A body stored whole (replayed in one write, or shared by the job's replays) and one
    over max_stored_body (streamed to the first client, its replay without it)."""
    options = {**store_options, "max_stored_body": 100 * 1024}
    client = await make_proxy(upstream=raw_upstream.url, **options)
    body = b"x" * size
    raw_upstream.response = upstream_answer([], body).replace(b"200 OK", b"202 Taken", 1)
    first, *replays = await first_and_replays(client, raw_upstream)
    assert (first.status_line, first.body) == (b"HTTP/1.1 202 Taken", body)
    for replay in replays:
        assert replay.status_line == b"HTTP/1.1 202 Taken"
        assert replay.body == (body if size <= 100 * 1024 else b"")


@pytest.mark.parametrize("store_options", ["sqlite"], indirect=True)
async def test_the_status_line_is_replayed_from_a_sealed_response(
    store_options: dict[str, Any], make_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    """With encryption at rest (SPEC §11) the phrase is sealed with the headers: not in the
    clear in the row, replayed as it came."""
    options = {**store_options, "encryption": {"keys": key_entry("k1", 1)}}
    client = await make_proxy(upstream=raw_upstream.url, **options)
    raw_upstream.response = upstream_answer(OBS_TEXT, b"ok").replace(b"200 OK", b"201 Booked", 1)
    answers = await first_and_replays(client, raw_upstream)
    assert [answer.status_line for answer in answers] == [b"HTTP/1.1 201 Booked"] * 3


@pytest.mark.parametrize("store_options", ["sqlite", "postgres"], indirect=True)
async def test_a_standard_phrase_is_stored_as_nothing_and_another_ahead_of_the_headers(
    client: TestClient[Any, Any], raw_upstream: RawUpstream
) -> None:
    store = client.app[CONTEXT].store
    raw_upstream.response = upstream_answer(OBS_TEXT, b"ok")
    standard, other = new_key(), new_key()
    assert (await exchange(client, post(b"pay", standard))).status == 200
    raw_upstream.response = upstream_answer(OBS_TEXT, b"ok").replace(b"200 OK", b"200 Fine", 1)
    assert (await exchange(client, post(b"pay", other))).status == 200
    kept = [await store.get("anonymous", key) for key in (standard, other)]
    headers = [job.response.headers for job in kept if job is not None and job.response]
    assert len(headers) == 2
    assert [name for name, _ in headers[0]] == [name.decode() for name, _ in OBS_TEXT]
    assert headers[1][0] == ("Idempotent-Replayed", "Fine") and headers[1][1:] == headers[0]


@pytest.mark.parametrize("store_options", ["sqlite"], indirect=True)
async def test_a_status_python_renamed_keeps_its_phrase_whatever_it_is(
    client: TestClient[Any, Any], raw_upstream: RawUpstream
) -> None:
    """Python 3.13 renamed the phrases of 413, 414, 416 and 422 (RFC 9110's names): a replay
    under another runtime than the first answer's would send another phrase than it did."""
    store = client.app[CONTEXT].store
    for status_line in (b"422 Unprocessable Entity", b"422 Unprocessable Content", b"413 "):
        raw_upstream.response = upstream_answer([], b"no").replace(b"200 OK", status_line, 1)
        key = new_key()
        answers = [await exchange(client, post(b"pay", key)) for _ in range(3)]
        assert [answer.status_line for answer in answers] == [b"HTTP/1.1 " + status_line] * 3
        assert [answer.get(b"Idempotent-Replayed") for answer in answers] == [
            None,
            b"true",
            b"true",
        ]
        job = await store.get("anonymous", key)
        assert job is not None and job.response is not None
        assert job.response.headers[0] == ("Idempotent-Replayed", status_line[4:].decode())


@pytest.mark.parametrize(
    "field",
    [(b"X-Nul", b"a\x00b"), (b"Transfer-Encoding", b"chunked\x01")],
    ids=["nul", "framing"],
)
@pytest.mark.parametrize("store_options", ["sqlite", "postgres"], indirect=True)
async def test_a_nul_or_a_control_in_framing_is_refused_and_the_job_unknown(
    client: TestClient[Any, Any], raw_upstream: RawUpstream, field: tuple[bytes, bytes]
) -> None:
    """RFC 9110 §5.5: NUL makes the message invalid; a framing field with a control character
    is not left out (the body would be framed by what is left). After the request went
    upstream its outcome is unknown (SPEC §3.2), as for any malformed response."""
    raw_upstream.response = upstream_answer([field], b"ok")
    key = new_key()
    answer = await exchange(client, post(b"pay", key))
    assert answer.status == 502 and answer.get(b"Idempotency-Error") == b"upstream-unavailable"
    job = await client.app[CONTEXT].store.get("anonymous", key)
    assert job is not None and job.state is JobState.UNKNOWN
    assert (await exchange(client, post(b"pay"))).status == 502


# --- the invariant: byte fidelity (property) ------------------------------------------------

# Every byte a field value may hold on the wire of a response head is drawn: all but CR and LF,
# which end the field (the parser refuses a lone CR).
_OWS = b" \t"
_CONTROLS = frozenset([*range(0x20), 0x7F]) - {0x09}
# Bodies over this stream to the first client and are not kept: both answer paths are drawn.
_MAX_STORED = 100


@dataclass(frozen=True)
class Sent:
    """An upstream's response: its end-to-end fields, body, and how the body is framed."""

    fields: Fields
    body: bytes
    chunked: bool

    @property
    def refused(self) -> bool:
        """NUL anywhere in a value: RFC 9110 §5.5, the whole response is refused."""
        return any(0 in value for _, value in self.fields)

    def expected(self) -> Fields:
        """What the client must get: each value without its surrounding whitespace (RFC 9110
        §5.5: not part of the value), a field with a control character left out (SPEC §10)."""
        stripped = [(name, value.strip(_OWS)) for name, value in self.fields]
        return [(n, v) for n, v in stripped if not _CONTROLS.intersection(v)]


_ACCEPTED = st.sampled_from([0x09, 0x20, *range(0x21, 0x7F), *range(0x80, 0x100)])
# NUL refuses the whole response, any other one leaves its field out. CR and LF end the field
# on the wire: a value cannot hold them.
_CONTROL = st.sampled_from(sorted(_CONTROLS - {0x0A, 0x0D}))


@st.composite
def _with_control(draw: st.DrawFn) -> bytes:
    value = draw(st.lists(_ACCEPTED, max_size=16))
    value.insert(draw(st.integers(0, len(value))), draw(_CONTROL))
    return bytes(value)


@st.composite
def responses(draw: st.DrawFn) -> Sent:
    """Mostly values of obs-text, HTAB and visible ASCII, now and then a control character;
    bodies below and above max_stored_body."""
    accepted = st.lists(_ACCEPTED, max_size=24).map(bytes)
    values = st.one_of(accepted, accepted, accepted, accepted, _with_control())
    drawn = draw(st.lists(values, max_size=6))
    fields = [(b"Content-Type", b"application/octet-stream")]
    fields += [(b"X-P%d" % i, value) for i, value in enumerate(drawn)]
    large = st.binary(min_size=_MAX_STORED + 1, max_size=4000)
    body = st.one_of(st.binary(max_size=_MAX_STORED), large)
    return Sent(fields, draw(body), draw(st.booleans()))


def _describe(sent: Sent) -> None:
    """What the examples covered (--hypothesis-show-statistics)."""
    values = b"".join(value for _, value in sent.fields)
    event("refused (NUL)" if sent.refused else "delivered")
    event(f"a field left out: {len(sent.expected()) < len(sent.fields)}")
    event(f"obs-text: {any(b >= 0x80 for b in values)}")
    event(f"streamed first answer: {len(sent.body) > _MAX_STORED}")
    event(f"chunked: {sent.chunked}")


def _assert_delivered(answer: Answer, sent: Sent, *, stored_body: bool = True) -> None:
    assert answer.status == 200, answer
    assert answer.upstream_fields() == sent.expected()
    assert answer.body == (sent.body if stored_body else b"")


@pytest.fixture
async def fidelity_client(
    store_options: dict[str, Any], make_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> TestClient[Any, Any]:
    options = {**store_options, "max_stored_body": _MAX_STORED}
    return await make_proxy(upstream=raw_upstream.url, **options)


@settings(
    max_examples=30,
    deadline=None,
    # One proxy and upstream for all examples; no shrinking (each try is four exchanges, and
    # the first falsifying example is reported as drawn).
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(sent=responses())
@example(sent=Sent([*OBS_TEXT[:2], (b"X-Ctl", b"a\x01b")], b"\xe9", chunked=False))
@example(sent=Sent([*OBS_TEXT[:2], (b"X-Nul", b"a\x00b")], b"ok", chunked=True))
async def test_every_accepted_byte_reaches_the_client_on_every_path(
    fidelity_client: TestClient[Any, Any], raw_upstream: RawUpstream, sent: Sent
) -> None:
    """Pass-through, first answer and two replays (from the store, then any cache): exactly
    the upstream's bytes, or, for a response the proxy refuses, a 502 and a settled job."""
    client = fidelity_client
    _describe(sent)
    raw_upstream.response = upstream_answer(sent.fields, sent.body, chunked=sent.chunked)
    passed = await exchange(client, post(b"pay"))
    key = new_key()
    first = await exchange(client, post(b"pay", key))
    replays = [await exchange(client, post(b"pay", key)) for _ in range(2)]
    if sent.refused:
        assert passed.status == first.status == 502, (passed, first)
        assert first.get(b"Idempotency-Error") == b"upstream-unavailable"
        for replay in replays:  # SPEC §3.2: settled unknown, never run again
            assert replay.status == 409 and replay.get(b"Idempotency-Error") == b"outcome-unknown"
        return
    _assert_delivered(passed, sent)
    _assert_delivered(first, sent)
    kept = len(sent.body) <= _MAX_STORED
    for replay in replays:
        assert replay.get(REPLAYED_HEADER.encode()) == b"true", replay
        _assert_delivered(replay, sent, stored_body=kept)
