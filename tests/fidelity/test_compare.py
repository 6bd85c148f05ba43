"""The fidelity suite's comparison tells every difference it does not list as allowed: a field
moved, its name's case changed, a repetition lost, a byte of the body or of the status line."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from tests.fidelity.compare import Volatile, assert_replay_of, assert_same_as_server
from tests.fidelity.wire import Answer

SERVER = Answer(
    b"HTTP/1.1 201 Created",
    (
        (b"Server", b"gunicorn"),
        (b"Date", b"Sun, 06 Dec 2026 04:00:00 GMT"),
        (b"Connection", b"keep-alive"),
        (b"Content-Length", b"9"),
        (b"Location", b"http://api.example.com/orders/1"),
        (b"Vary", b"Origin"),
        (b"Vary", b"Accept"),
        (b"x-request-id", b"r-1"),
    ),
    b'{"id": 1}',
    chunked=False,
)
# The same answer as the proxy gives it: hop-by-hop gone, Content-Length last, another Date, the
# job named.
PROXIED = Answer(
    b"HTTP/1.1 201 Created",
    (
        (b"Server", b"gunicorn"),
        (b"Date", b"Sun, 06 Dec 2026 04:00:01 GMT"),
        (b"Location", b"http://api.example.com/orders/1"),
        (b"Vary", b"Origin"),
        (b"Vary", b"Accept"),
        (b"x-request-id", b"r-1"),
        (b"Idempotency-Job", b"job-1"),
        (b"Content-Length", b"9"),
    ),
    b'{"id": 1}',
    chunked=False,
)


def _swap(
    fields: tuple[tuple[bytes, bytes], ...], i: int, j: int
) -> tuple[tuple[bytes, bytes], ...]:
    swapped = list(fields)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    return tuple(swapped)


def test_the_allowed_differences_pass() -> None:
    assert_same_as_server(SERVER, PROXIED, governed=True)


@pytest.mark.parametrize(
    "changed",
    [
        replace(PROXIED, status_line=b"HTTP/1.1 201 CREATED"),
        replace(PROXIED, body=b'{"id": 2}'),
        replace(PROXIED, fields=_swap(PROXIED.fields, 2, 3)),  # Location after Vary
        replace(PROXIED, fields=_swap(PROXIED.fields, 3, 4)),  # the two Vary values swapped
        replace(PROXIED, fields=PROXIED.fields[:4] + PROXIED.fields[5:]),  # a Vary lost
        replace(PROXIED, fields=((b"server", b"gunicorn"), *PROXIED.fields[1:])),  # case
        replace(PROXIED, fields=(*PROXIED.fields, (b"X-Extra", b"1"))),
        replace(PROXIED, fields=PROXIED.fields[:6] + PROXIED.fields[7:]),  # no Idempotency-Job
        replace(PROXIED, fields=(*PROXIED.fields[:7], (b"Content-Length", b"8"))),
    ],
)
def test_any_other_difference_fails(changed: Answer) -> None:
    with pytest.raises(AssertionError):
        assert_same_as_server(SERVER, changed, governed=True)


def test_a_volatile_value_is_masked_where_it_is_and_only_there() -> None:
    other_id = ((b"x-request-id", b"r-2"),)
    changed = replace(PROXIED, fields=PROXIED.fields[:5] + other_id + PROXIED.fields[6:])
    request_id = Volatile(b"x-request-id", None, "per request")
    assert_same_as_server(SERVER, changed, (request_id,), governed=True)
    with pytest.raises(AssertionError):
        assert_same_as_server(SERVER, changed, governed=True)
    in_body = Volatile(None, re.compile(rb'"id": (\d+)'), "per execution")
    assert_same_as_server(SERVER, replace(PROXIED, body=b'{"id": 7}'), (in_body,), governed=True)


def test_a_replay_differs_only_by_its_date_and_the_replayed_field() -> None:
    replay = replace(
        PROXIED,
        fields=(
            *PROXIED.fields[:1],
            *PROXIED.fields[2:7],
            (b"Idempotent-Replayed", b"true"),
            (b"Content-Length", b"9"),
            (b"Date", b"Sun, 06 Dec 2026 04:00:09 GMT"),
        ),
    )
    assert_replay_of(PROXIED, replay)
    without = replace(
        replay, fields=tuple(f for f in replay.fields if f[0] != b"Idempotent-Replayed")
    )
    with pytest.raises(AssertionError):
        assert_replay_of(PROXIED, without)
    with pytest.raises(AssertionError):
        assert_replay_of(PROXIED, replace(replay, body=b'{"id": 2}'))
