"""SPEC §8: only the proxy's own answers carry `Idempotency-Error`.

An upstream sending it (its own error vocabulary, or a proxy further down) would make clients and
the batch runner take a backend's 200 for the proxy's refusal. It is dropped on the first answer,
never stored (so never replayed), and dropped in pass-through, on both stores.
"""

from __future__ import annotations

from idemproxy.core.types import StoredResponse
from idemproxy.store.base import Store
from tests.support.faultproxy import FaultProxy, replace
from tests.support.proxyapp import ProxyFactory
from tests.support.proxychecks import KEY, REPLAYED, wait_for_jobs

ANSWER = (
    b"HTTP/1.1 200 OK\r\nIdempotency-Error: payload-mismatch\r\n"
    b"idempotency-error: outcome-unknown\r\nX-Kept: yes\r\nContent-Length: 2\r\n\r\nok"
)


async def test_an_upstreams_idempotency_error_never_reaches_the_client(
    proxy: ProxyFactory, fault_proxy: FaultProxy, jobs: Store
) -> None:
    client = await proxy(upstream=fault_proxy.url)
    fault_proxy.inject(replace(ANSWER))
    async with client.post("/pay", data=b"x", headers={KEY: "err"}) as first:
        assert (first.status, await first.read()) == (200, b"ok")
        assert "Idempotency-Error" not in first.headers
        assert first.headers["X-Kept"] == "yes"
    [job] = await wait_for_jobs(jobs)
    assert isinstance(job.response, StoredResponse)
    assert [n for n, _ in job.response.headers if n.lower() == "idempotency-error"] == []
    async with client.post("/pay", data=b"x", headers={KEY: "err"}) as replay:
        assert replay.headers[REPLAYED] == "true"
        assert "Idempotency-Error" not in replay.headers
        assert replay.headers["X-Kept"] == "yes"

    fault_proxy.inject(replace(ANSWER))
    async with client.get("/things") as passed:
        assert (passed.status, await passed.read()) == (200, b"ok")
        assert "Idempotency-Error" not in passed.headers
