"""One proxy on the embedded SQLite store: a double click, then a restart (SPEC §11)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from tests.support.client import send

if TYPE_CHECKING:
    from .conftest import Backend, StartProxy

pytestmark = pytest.mark.slow


async def test_double_click_executes_once_and_survives_a_restart(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy
) -> None:
    # An absolute path, in a directory of its own (a missing one is a start-up error).
    (tmp_path / "data").mkdir()
    store = f"sqlite:///{tmp_path}/data/idemproxy.db"
    args = ("--upstream", backend.url, "--store", store)
    proxy = await start_proxy(*args)
    key = "checkout-7"
    async with aiohttp.ClientSession() as session:
        clicks = await asyncio.gather(
            send(session, f"{proxy.url}/orders?delay=0.2", key=key),
            send(session, f"{proxy.url}/orders?delay=0.2", key=key),
        )
    assert backend.ledger.count(key) == 1, proxy.describe()
    assert [c.status for c in clicks] == [201, 201]
    assert clicks[0].body == clicks[1].body
    assert sorted(c.replayed for c in clicks) == [False, True]
    job = clicks[0].job
    assert job is not None
    assert clicks[1].job == job

    assert await proxy.terminate() == 0, proxy.describe()
    assert (tmp_path / "data" / "idemproxy.db").is_file()

    restarted = await start_proxy(*args, port=proxy.port)
    async with aiohttp.ClientSession() as session:
        retry = await send(session, f"{restarted.url}/orders?delay=0.2", key=key)
        reused = await send(session, f"{restarted.url}/orders?delay=0.2", key=key, body=b"{}")
    assert (retry.status, retry.replayed, retry.job) == (201, True, job), restarted.describe()
    assert retry.body == clicks[0].body
    assert retry.headers["Location"] == clicks[0].headers["Location"]
    # The fingerprint survived too: the same key with another payload is still a conflict.
    assert (reused.status, reused.error) == (409, "payload-mismatch")
    assert backend.ledger.count(key) == 1
