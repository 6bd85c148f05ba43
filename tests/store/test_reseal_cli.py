"""`idemproxy store reseal` (SPEC §11) on a real store, its key ring from the environment:
counts reported, run again it does nothing, a row whose key is gone is exit status 1; and what
`jobs show --include-response` makes of a sealed response."""

from __future__ import annotations

import asyncio

import pytest

from idemproxy.cli import main as cli
from idemproxy.core.types import SealedResponse
from idemproxy.ops import service
from idemproxy.ops.view import job_to_json
from idemproxy.store.factory import create_store
from idemproxy.store.layers import StoreStack
from idemproxy.store.ports import JobStore
from idemproxy.store.seal.store import SealingStore
from tests.support.keyring import NEW, OLD, OTHER, codec
from tests.support.stores import opened

from .test_contract import TTL, claim, job_of
from .test_contract_sealed import PRIVATE, sealing


async def _complete(store: JobStore, key: str) -> str:
    claimed = await claim(store, key)
    assert await store.complete(claimed.job, 1, PRIVATE, ttl=TTL)
    return claimed.job.id


async def _reseal(dsn: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = await asyncio.to_thread(
        cli.main, ["store", "reseal", "--store", dsn, "--batch-size", "2"]
    )
    return code, capsys.readouterr().out


async def test_reseal_reports_what_it_did_and_then_finds_nothing(
    store_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async with opened(create_store(store_dsn)) as store:
        ids = [await _complete(store, "clear")]
        ids += [await _complete(SealingStore(store, codec(OLD)), f"old-{n}") for n in range(2)]
    monkeypatch.setenv("IDEMPROXY_ENCRYPTION__KEYS", f"{NEW},{OLD}")

    code, out = await _reseal(store_dsn, capsys)
    assert code == 0
    assert "resealed 3 response(s) and 0 late response(s) with key 'k2'" in out
    assert (await _reseal(store_dsn, capsys))[1].startswith("resealed 0 response(s)")
    async with opened(create_store(store_dsn)) as store:
        for job_id in ids:
            response = (await job_of(store, job_id)).response
            assert isinstance(response, SealedResponse) and response.key_id == "k2"


async def test_reseal_fails_naming_rows_whose_key_is_gone(
    store_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async with opened(create_store(store_dsn)) as store:
        lost = await _complete(SealingStore(store, codec(OTHER)), "lost")
    monkeypatch.setenv("IDEMPROXY_ENCRYPTION__KEYS", NEW)
    code, out = await _reseal(store_dsn, capsys)
    assert (
        code == 1
        and f"1 unreadable (sealed with a key not in the ring), left as they are: {lost}" in out
    )


async def test_reseal_without_a_ring_is_refused(
    store_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with opened(create_store(store_dsn)):
        pass
    code = await asyncio.to_thread(cli.main, ["store", "reseal", "--store", store_dsn])
    assert code == 2 and "needs encryption.keys" in capsys.readouterr().err


async def test_show_opens_a_sealed_response_or_says_which_key_it_needs(stack: StoreStack) -> None:
    job_id = await _complete(sealing(stack, codec(OLD)), "shown")
    job = await job_of(stack.record, job_id)
    with_key = job_to_json(service.shown(stack.record, job), include_response=True)
    assert with_key["response"]["body"] == PRIVATE.body.decode()  # type: ignore[union-attr]
    stack.record.seal = None
    without = job_to_json(service.shown(stack.record, job), include_response=True)
    assert without["response"] == {"status": 201, "omitted": False, "sealed_with": "k1"}
