"""RFC 9112 §6.3: an upstream's framing is read from every Transfer-Encoding line, as llhttp
reads it. With `chunked` on the first line and `identity` on the next, llhttp (rightly) reads the
body until the connection closes; the proxy looked at the first line only, took the body for
chunked and failed it as cut off: a 502 for a POST the upstream had answered (its job unknown)
and an ERROR traceback in pass-through.
"""

from __future__ import annotations

import logging

import pytest

from backend import Ledger
from faultproxy import FaultProxy, replace
from proxy.conftest import ProxyFactory
from proxy.support import KEY, REPLAYED

BODY = b"2\r\nok\r\n0\r\n\r\n"  # what a close-delimited body holds here: the bytes as sent
ANSWER = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n"


async def test_a_final_coding_other_than_chunked_is_read_until_close(
    make_proxy: ProxyFactory,
    fault_proxy: FaultProxy,
    sqlite_dsn: str,
    ledger: Ledger,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = await make_proxy(store=sqlite_dsn, upstream=fault_proxy.url)
    caplog.set_level(logging.WARNING)
    fault_proxy.inject(replace(ANSWER + BODY))
    async with client.post("/pay", data=b"x", headers={KEY: "te"}) as first:
        assert (first.status, await first.read()) == (200, BODY)
    async with client.post("/pay", data=b"x", headers={KEY: "te"}) as replay:
        assert replay.headers[REPLAYED] == "true"
        assert await replay.read() == BODY
    fault_proxy.inject(replace(ANSWER + BODY))
    async with client.get("/things") as passed:
        assert (passed.status, await passed.read()) == (200, BODY)
    assert ledger.count("te") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
