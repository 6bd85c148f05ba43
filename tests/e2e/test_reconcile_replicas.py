"""Two proxy processes on one PostgreSQL database reconcile the same unknown job (SPEC §3.6):
one question at a time, one execution, the job resolved once, replayed by both."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest
import yaml

from idemproxy.core.types import JobState
from idemproxy.store.factory import create_store
from tests.support.client import send
from tests.support.reconciling import Payments, payments_backend
from tests.support.stores import opened

if TYPE_CHECKING:
    from .conftest import StartProxy

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


async def test_two_replicas_resolve_an_unknown_job_once(
    pg_dsn: str, start_proxy: StartProxy, tmp_path: Path
) -> None:
    payments = Payments(delay=1.5)  # still charging for a while after the proxy's timeout
    async with payments_backend(payments) as backend:
        reconcile = {"url": f"{backend}/reconcile", "timeout": "1s", "backoff": "100ms",
                     "max_backoff": "200ms"}  # fmt: skip
        route = {"prefix": "/payments", "upstream": backend, "upstream_timeout": "500ms",
                 "resolve": {"reconcile": reconcile}}  # fmt: skip
        config = tmp_path / "resolve.yaml"
        config.write_text(
            yaml.safe_dump({"routes": [route], "sweeper": {"reconcile_interval": 0.05}})
        )
        proxies = await asyncio.gather(
            *(start_proxy("--config", str(config), "--store", pg_dsn, name=n) for n in "ab")
        )
        async with aiohttp.ClientSession() as session:
            first = await send(session, proxies[0].url + "/payments", key="order-9")
            assert first.status == 504
            job_id = json.loads(first.body)["instance"].rpartition(":")[2]
            async with opened(create_store(pg_dsn)) as store:
                deadline = time.monotonic() + 20
                while (job := await store.get_by_id(job_id)) is None or (
                    job.state is not JobState.COMPLETED
                ):
                    assert time.monotonic() < deadline, [p.describe() for p in proxies]
                    await asyncio.sleep(0.1)
            later = [await send(session, p.url + "/payments", key="order-9") for p in proxies]
    assert job.resolution == "reconcile"
    (attempt,) = job.attempts
    # One question per check, whichever replica asked it; none while another was unanswered.
    assert len(payments.questions) == attempt.checks >= 2
    assert payments.executions["order-9"] == 1
    assert [(a.status, a.replayed) for a in later] == [(201, True)] * 2
