"""Fixtures for the batch tests: a scripted API in-process, and the paid endpoint + real proxy."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from .paid import Charges, paid_app
from .scripted import Calls, scripted_app
from .servers import start_app, start_proxy, stop_process


@pytest.fixture
def calls() -> Calls:
    return Calls()


@pytest.fixture
async def api_url(calls: Calls) -> AsyncIterator[str]:
    runner, url = await start_app(scripted_app(calls))
    try:
        yield url
    finally:
        await runner.cleanup()


@pytest.fixture
def charges() -> Charges:
    return Charges(delay=0.01)


@pytest.fixture
async def paid_url(charges: Charges) -> AsyncIterator[str]:
    runner, url = await start_app(paid_app(charges))
    try:
        yield url
    finally:
        await runner.cleanup()


@pytest.fixture
async def proxy_url(paid_url: str, tmp_path: Path) -> AsyncIterator[str]:
    """The real proxy, `idemproxy serve` as a process, in front of the paid endpoint."""
    process, url = await start_proxy(paid_url, tmp_path)
    try:
        yield url
    finally:
        await stop_process(process)
