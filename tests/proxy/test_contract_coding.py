"""SPEC §3.4: a contract route checks an upstream's answer decoded, and passes it on as sent.

Python's requests, httpx and the OpenAI SDK send `Accept-Encoding: gzip, deflate` by default,
and many backends then answer gzip. The contract was checked on the coded bytes ("body is not
JSON"): every valid answer was a breach, its job `unknown`. Now a gzip or deflate answer is
decoded for the check, stored and replayed as the upstream sent it; one the proxy cannot decode
stays a breach that names its coding, and the upstreams of a contract route are asked only for
codings the proxy can decode.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from idemproxy.core.types import AttemptState, JobState, StoredResponse
from idemproxy.store.base import Store
from tests.support.named_upstream import WRONG_SHAPE
from tests.support.proxychecks import KEY, REPLAYED, assert_problem, only_job

from .conftest import ProxyFactory
from .test_groups import PROMPT, contract_route, eligible

ANSWER: dict[str, Any] = {"id": "chat-1", "choices": [{"text": "an idempotency key is ..."}]}
# Not brotli (there is no encoder here): bytes labelled `br` that the proxy cannot decode.
NOT_REALLY_BR = b"\x1b\x00\xf8\xff opaque"


def coded(document: dict[str, Any], coding: str) -> bytes:
    plain = json.dumps(document).encode()
    if coding == "gzip":
        return gzip.compress(plain, mtime=0)
    if coding == "deflate":
        return zlib.compress(plain)
    if coding == "br":
        return NOT_REALLY_BR
    return plain


class CodingUpstream:
    """A backend that honours Accept-Encoding: it answers with the first coding of `prefers`
    the request accepts (a coding listed without `q=0`), identity when none; or always with
    `always`, whatever the request asked. Records each request's Accept-Encoding and what it
    sent."""

    def __init__(self, document: dict[str, Any], prefers: tuple[str, ...]) -> None:
        self.document = document
        self.prefers = prefers
        self.always: str | None = None
        self.asked: list[str | None] = []
        self.sent: list[bytes] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        asked = request.headers.get("Accept-Encoding")
        self.asked.append(asked)
        coding = self.always or self._chosen(asked)
        body = coded(self.document, coding)
        self.sent.append(body)
        response = web.Response(status=201, body=body, content_type="application/json")
        if coding != "identity":
            response.headers["Content-Encoding"] = coding
        return response

    def _chosen(self, asked: str | None) -> str:
        accepted = set()
        for element in (asked or "").split(","):
            name, _, parameters = element.partition(";")
            if parameters.replace(" ", "") not in ("q=0", "q=0.0"):
                accepted.add(name.strip().lower())
        return next((c for c in self.prefers if c in accepted), "identity")


StartCoding = Callable[..., Awaitable[CodingUpstream]]


@pytest.fixture
async def start_coding() -> AsyncIterator[StartCoding]:
    servers: list[TestServer] = []

    async def start(
        document: dict[str, Any] = ANSWER, prefers: tuple[str, ...] = ("gzip", "deflate")
    ) -> CodingUpstream:
        upstream = CodingUpstream(document, prefers)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", upstream.handle)
        server = TestServer(app)
        await server.start_server()
        servers.append(server)
        upstream.url = f"http://{server.host}:{server.port}"
        return upstream

    try:
        yield start
    finally:
        for server in servers:
            await server.close()


def send(client: Any, key: str, accept_encoding: str) -> Any:
    return client.post(
        "/v1/chat", json=PROMPT, headers={KEY: key, "Accept-Encoding": accept_encoding}
    )


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_a_coded_answer_that_honours_the_contract_completes_and_replays_as_sent(
    proxy: ProxyFactory, start_coding: StartCoding, jobs: Store, tmp_path: Path, coding: str
) -> None:
    primary = await start_coding(prefers=(coding,))
    client = await proxy(routes=contract_route(tmp_path, primary.url, []))

    async with send(client, "coded", coding) as response:
        assert response.status == 201, await response.read()
        assert response.headers["Content-Encoding"] == coding
        assert await response.read() == primary.sent[0]  # the upstream's bytes, not decoded
    async with send(client, "coded", coding) as response:
        assert (response.status, response.headers.get(REPLAYED)) == (201, "true")
        assert response.headers["Content-Encoding"] == coding
        assert await response.read() == primary.sent[0]
    assert len(primary.sent) == 1
    job = await only_job(jobs)
    assert job.state is JobState.COMPLETED
    assert isinstance(job.response, StoredResponse) and job.response.body == primary.sent[0]


async def test_a_gzip_answer_that_breaks_the_schema_is_still_a_breach(
    proxy: ProxyFactory, start_coding: StartCoding, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_coding(WRONG_SHAPE)
    client = await proxy(routes=contract_route(tmp_path, primary.url, []))

    async with send(client, "wrong", "gzip") as response:
        await assert_problem(response, "contract-violation", 502)
    async with send(client, "wrong", "gzip") as response:
        await assert_problem(response, "outcome-unknown", 409)
    assert len(primary.sent) == 1
    job = await only_job(jobs)
    assert (job.state, job.response) == (JobState.UNKNOWN, None)
    error = job.attempts[0].error
    assert error is not None and error.startswith("contract: ")
    assert "choices" in error  # the decoded document's breach, not "body is not JSON"


@pytest.mark.parametrize(
    ("asked", "forwarded", "coding"),
    [
        ("br, gzip;q=0.8, zstd, *", "gzip;q=0.8", "gzip"),
        ("br;q=1.0, deflate, x-gzip;q=0.5, identity", "deflate, x-gzip;q=0.5, identity", "deflate"),
        ("br, zstd", "identity", "identity"),
    ],
    ids=["gzip-kept", "deflate-kept", "none-left"],
)
async def test_a_contract_route_asks_upstreams_only_for_codings_it_can_check(
    proxy: ProxyFactory,
    start_coding: StartCoding,
    jobs: Store,
    tmp_path: Path,
    asked: str,
    forwarded: str,
    coding: str,
) -> None:
    """An upstream preferring br would make every answer uncheckable: it is not offered br."""
    primary = await start_coding(prefers=("br", "zstd", "gzip", "deflate"))
    client = await proxy(routes=contract_route(tmp_path, primary.url, []))

    async with send(client, "asked", asked) as response:
        assert response.status == 201, await response.read()
        assert response.headers.get("Content-Encoding", "identity") == coding
    assert primary.asked == [forwarded]
    assert (await only_job(jobs)).state is JobState.COMPLETED


async def test_a_route_without_a_contract_passes_accept_encoding_on_as_sent(
    proxy: ProxyFactory, start_coding: StartCoding
) -> None:
    primary = await start_coding(prefers=("br", "gzip"))
    client = await proxy(routes=[{"prefix": "/v1", "upstream": primary.url}])

    async with send(client, "plain", "br, gzip") as response:
        assert response.headers["Content-Encoding"] == "br"
        assert await response.read() == NOT_REALLY_BR
    assert primary.asked == ["br, gzip"]


async def test_a_br_answer_sent_regardless_cannot_be_checked_and_is_a_breach_naming_it(
    proxy: ProxyFactory, start_coding: StartCoding, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_coding()
    primary.always = "br"  # ignores the Accept-Encoding it was sent
    client = await proxy(routes=contract_route(tmp_path, primary.url, []))

    async with send(client, "br", "gzip, br") as response:
        await assert_problem(response, "contract-violation", 502)
        assert NOT_REALLY_BR not in await response.read()
    async with send(client, "br", "gzip, br") as response:
        await assert_problem(response, "outcome-unknown", 409)
    assert primary.asked == ["gzip"]
    job = await only_job(jobs)
    assert (job.state, job.response) == (JobState.UNKNOWN, None)
    assert [(a.state, a.error) for a in job.attempts] == [
        (
            AttemptState.UNKNOWN,
            "contract: body coded with br cannot be checked against the contract: only gzip"
            " and deflate are decoded, up to max_stored_body bytes",
        )
    ]


async def test_a_gzip_answer_decoding_past_max_stored_body_is_a_breach_naming_it(
    proxy: ProxyFactory, start_coding: StartCoding, jobs: Store, tmp_path: Path
) -> None:
    large = ANSWER | {"choices": [{"text": "x" * 4096}]}
    primary = await start_coding(large)
    client = await proxy(routes=contract_route(tmp_path, primary.url, []), max_stored_body=1024)

    async with send(client, "bomb", "gzip") as response:
        await assert_problem(response, "contract-violation", 502)
    assert len(primary.sent[0]) < 1024  # stored whole, but decodes to more
    job = await only_job(jobs)
    error = job.attempts[0].error
    assert error is not None and error.startswith("contract: body coded with gzip cannot be")


async def test_a_fallback_answering_its_samples_gzip_is_eligible(
    proxy: ProxyFactory, start_coding: StartCoding, tmp_path: Path
) -> None:
    primary = await start_coding()
    fallback = await start_coding(prefers=("br", "gzip"))
    samples = tmp_path / "coded.samples.jsonl"
    sample = {"path": "/v1/chat", "headers": {"Accept-Encoding": "br, gzip"}, "body": PROMPT}
    samples.write_text(json.dumps(sample) + "\n")
    routes = contract_route(tmp_path, primary.url, [fallback.url], samples_file=str(samples))
    client = await proxy(routes=routes)

    assert fallback.asked == ["gzip"]
    assert fallback.sent == [coded(ANSWER, "gzip")]
    assert eligible(client) == (fallback.url,)
