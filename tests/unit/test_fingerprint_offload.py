"""The fingerprint and the pointer key of a large body, worked out in a worker process
(http/offload.py), are what this process works out for the same body (SPEC §4.1, §6)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from idemproxy.errors import BodyTooLarge, KeyInvalid
from idemproxy.http.offload import IN_PROCESS_BYTES, Offload
from idemproxy.identity.intent import fingerprint
from idemproxy.identity.key_source import KeySource

HEAD = ("POST", "/orders", "", "application/json; charset=utf-8", "", None)
PAD = b"x" * IN_PROCESS_BYTES  # every body below is large enough for a worker process
DEEP = b"[" * 5_000 + b"]" * 5_000

BODIES = [
    b'{"order_id":"a","pad":"%s","n":[-0,1E2,100.0,0.30000000000000000001,9e999]}' % PAD,
    b'{"pad": "%s", "order_id": "a", "s": "\\ud800\\u00e9\xc3\xa9"}' % PAD,  # lone surrogate
    b'{"order_id":"a","order_id":"b","pad":"%s"}' % PAD,  # a repeated name: raw bytes
    b'{"order_id":"a","pad":"%s","x":NaN}' % PAD,  # not JSON: raw bytes
    b'{"order_id":"a","pad":"%s","deep":%s}' % (PAD, DEEP),  # too deep for the C parser
    (b'{"order_id":"a","pad":"%s"}' % PAD).decode().encode("utf-16"),
    b"[%s]" % b",".join(b'{"order_id":"%d"}' % n for n in range(10_000)),
    b'"%s"' % PAD,  # a JSON string
]


@pytest.fixture
async def offload() -> AsyncIterator[Offload]:
    work = Offload(processes=1)
    try:
        yield work
    finally:
        await work.close()


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
@pytest.mark.parametrize("exclude", [(), ("/pad", "/n/0")])
async def test_a_worker_process_gives_this_process_fingerprint(
    offload: Offload, body: bytes, exclude: tuple[str, ...]
) -> None:
    assert len(body) > IN_PROCESS_BYTES
    assert await offload(body, fingerprint, HEAD, body, exclude) == fingerprint(HEAD, body, exclude)


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
async def test_a_worker_process_gives_this_process_key(offload: Offload, body: bytes) -> None:
    source = KeySource.of(None, "/order_id", "order-")
    try:
        here: str | type[Exception] | None = source.body_key(body)
    except KeyInvalid:
        here = KeyInvalid
    try:
        there: str | type[Exception] | None = await offload(body, source.body_key, body)
    except KeyInvalid:
        there = KeyInvalid
    assert there == here


async def test_a_deep_body_over_1_mib_is_refused_from_a_worker_process(offload: Offload) -> None:
    levels = 600_000
    body = b'{"order_id": "deep", "x": %s}' % (b"[" * levels + b"]" * levels)
    source = KeySource.of(None, "/order_id", "")
    with pytest.raises(BodyTooLarge, match="deeper than about 1,000 levels"):
        await offload(body, source.body_key, body)
