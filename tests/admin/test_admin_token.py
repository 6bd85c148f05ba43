"""SPEC §13: the admin token, as a hostile client sends it (raw bytes, on a real listener)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from idemproxy.admin.app import Readiness, create_admin_app
from idemproxy.store.base import Store

from .conftest import TOKEN, MakeSettings


@pytest.fixture
async def admin_address(
    store: Store, make_settings: MakeSettings
) -> AsyncIterator[tuple[str, int]]:
    app = create_admin_app(make_settings(admin={"token": TOKEN}), store, Readiness())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][:2]
    finally:
        await runner.cleanup()


async def get_jobs(address: tuple[str, int], auth_lines: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(
            b"GET /jobs HTTP/1.1\r\nHost: admin\r\n" + auth_lines + b"Connection: close\r\n\r\n"
        )
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


REFUSED = {
    "latin-1 byte": b"Authorization: Bearer admin-token-27\xe9\r\n",
    "utf-8 letter": "Authorization: Bearer admin-token-2718\u00e9\r\n".encode(),
    "invalid utf-8": b"Authorization: Bearer \xff\xfe\r\n",
    "right token repeated after a wrong one": (
        b"Authorization: Bearer wrong\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n"
    ),
    "right token twice": (b"Authorization: Bearer " + TOKEN.encode() + b"\r\n") * 2,
}


@pytest.mark.parametrize("case", REFUSED)
async def test_a_token_that_is_not_the_one_is_401_never_500(
    admin_address: tuple[str, int], case: str, caplog: pytest.LogCaptureFixture
) -> None:
    answer = await get_jobs(admin_address, REFUSED[case])
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert b"WWW-Authenticate: Bearer\r\n" in answer
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a bad token"


async def test_the_right_token_once_is_accepted(admin_address: tuple[str, int]) -> None:
    answer = await get_jobs(admin_address, b"Authorization: Bearer " + TOKEN.encode() + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
