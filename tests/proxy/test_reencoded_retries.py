"""A retry its client encoded anew is the same request (SPEC §6, identity/reencoded.py).

Clients build a request again for each try: aiohttp's `FormData` and `requests`' `files=` draw a
new multipart boundary every time, and a gzip body compressed again carries another time stamp.
Such a retry was `409 payload-mismatch` with `retry: new-key-safe`: a client following that hint
ran the upload twice. Now it is held or replayed, whether the body stays in memory or is spooled
to disk, and a form with other parts is still refused.
"""

from __future__ import annotations

import asyncio
import gzip
import io
from collections.abc import AsyncIterator

import aiohttp
import pytest
import requests
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from idemproxy.config.settings import load_settings
from idemproxy.proxy.app import create_app

MiB = 1024 * 1024
RECEIVED = web.AppKey("received", list)


async def _record(request: web.Request) -> web.Response:
    body = await request.read()
    request.app[RECEIVED].append(body)
    return web.json_response({"received": len(request.app[RECEIVED])}, status=201)


@pytest.fixture
async def upstream() -> AsyncIterator[TestServer]:
    app = web.Application(client_max_size=64 * MiB)
    app[RECEIVED] = []
    app.router.add_post("/{tail:.*}", _record)
    server = TestServer(app)
    async with server:
        yield server


@pytest.fixture
async def client(
    upstream: TestServer, sqlite_dsn: str
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    settings = load_settings(
        upstream=str(upstream.make_url("")).rstrip("/"),
        store=sqlite_dsn,
        server={"spool_threshold": MiB},
        max_request_body=16 * MiB,
    )
    async with TestClient(TestServer(create_app(settings))) as test_client:
        yield test_client


def _file(size: int, seed: int = 7) -> bytes:
    return bytes((i * seed) % 251 for i in range(size))


def _form(content: bytes) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", io.BytesIO(content), filename="items.jsonl")
    return form


SIZES = [pytest.param(200, id="in-memory"), pytest.param(3 * MiB + 5, id="spooled")]


@pytest.mark.parametrize("size", SIZES)
async def test_a_form_sent_again_under_a_new_boundary_is_replayed(
    client: TestClient[web.Request, web.Application], upstream: TestServer, size: int
) -> None:
    content = _file(size)
    headers = {"Idempotency-Key": f"upload-{size}"}
    first = await client.post("/v1/files", data=_form(content), headers=headers)
    again = await client.post("/v1/files", data=_form(content), headers=headers)
    assert first.status == again.status == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await again.read() == await first.read()
    assert len(upstream.app[RECEIVED]) == 1
    sent = [answer.request_info.headers["Content-Type"] for answer in (first, again)]
    assert sent[0] != sent[1], "the client sent the same boundary twice: nothing was tested"


@pytest.mark.parametrize("size", SIZES)
async def test_a_form_with_another_file_is_still_a_mismatch(
    client: TestClient[web.Request, web.Application], upstream: TestServer, size: int
) -> None:
    headers = {"Idempotency-Key": f"other-{size}"}
    first = await client.post("/v1/files", data=_form(_file(size)), headers=headers)
    other = await client.post("/v1/files", data=_form(_file(size, seed=11)), headers=headers)
    assert first.status == 201
    assert other.status == 409 and other.headers["Idempotency-Error"] == "payload-mismatch"
    assert len(upstream.app[RECEIVED]) == 1


async def test_requests_files_retried_by_the_application_is_replayed(
    client: TestClient[web.Request, web.Application], upstream: TestServer
) -> None:
    """`requests` draws a new boundary for each call, as the SDKs built on it do."""
    url = str(client.make_url("/v1/files"))

    def upload() -> requests.Response:
        return requests.post(
            url,
            files={"file": ("items.jsonl", b'{"x":1}\n')},
            data={"purpose": "batch"},
            headers={"Idempotency-Key": "requests-upload"},
            timeout=10,
        )

    first = await asyncio.to_thread(upload)
    again = await asyncio.to_thread(upload)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert first.request.headers["Content-Type"] != again.request.headers["Content-Type"]
    assert len(upstream.app[RECEIVED]) == 1


@pytest.mark.parametrize("size", SIZES)
async def test_a_body_gzipped_again_is_replayed(
    client: TestClient[web.Request, web.Application], upstream: TestServer, size: int
) -> None:
    content = _file(size)
    headers = {
        "Idempotency-Key": f"gzip-{size}",
        "Content-Type": "application/octet-stream",
        "Content-Encoding": "gzip",
    }
    # Stored, not compressed: the body stays as large as the content, spooled or not.
    first_body = gzip.compress(content, compresslevel=0, mtime=1_700_000_000)
    again_body = gzip.compress(content, compresslevel=0, mtime=1_700_000_042)
    assert first_body != again_body
    first = await client.post("/v1/batches", data=io.BytesIO(first_body), headers=headers)
    again = await client.post("/v1/batches", data=io.BytesIO(again_body), headers=headers)
    assert first.status == again.status == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    other = await client.post(
        "/v1/batches", data=io.BytesIO(gzip.compress(content + b"!", mtime=1)), headers=headers
    )
    assert other.status == 409
    assert upstream.app[RECEIVED] == [content]  # decoded by the backend's server, once


@pytest.mark.parametrize("size", SIZES)
async def test_forms_a_parser_reads_apart_are_a_mismatch_in_memory_or_spooled(
    client: TestClient[web.Request, web.Application], upstream: TestServer, size: int
) -> None:
    """A line that begins with the boundary and goes on is content to a parser: under `ab` the
    part ends `--abZ`, under `a` it ends `--aZ`, two different files (reviewed on Werkzeug)."""
    content = _file(size)
    disposition = b'Content-Disposition: form-data; name="f"; filename="f"\r\n\r\n'

    def body(boundary: bytes) -> bytes:
        start, end = b"--" + boundary, b"\r\n--" + boundary
        return start + b"\r\n" + disposition + content + end + b"Z" + end + b"--\r\n"

    headers = {"Idempotency-Key": f"apart-{size}"}
    first = await client.post(
        "/v1/files",
        data=io.BytesIO(body(b"ab")),
        headers={**headers, "Content-Type": "multipart/form-data; boundary=ab"},
    )
    other = await client.post(
        "/v1/files",
        data=io.BytesIO(body(b"a")),
        headers={**headers, "Content-Type": "multipart/form-data; boundary=a"},
    )
    assert first.status == 201
    assert other.status == 409 and other.headers["Idempotency-Error"] == "payload-mismatch"
    assert len(upstream.app[RECEIVED]) == 1
