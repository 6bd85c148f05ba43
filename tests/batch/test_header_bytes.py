"""An answer's header bytes that are not UTF-8 (obs-text, RFC 9110 §5.5) still give a result
line that strict JSON readers take (SPEC §14). aiohttp's client decodes such a byte as a lone
surrogate, which the results file's UTF-8 could not hold: the run failed writing the line."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from idemproxy.batch import BatchOptions, run_batch

ANSWER = (
    b"HTTP/1.1 201 Created\r\nContent-Type: application/json; note=caf\xe9\r\n"
    b'Content-Length: 11\r\nConnection: close\r\n\r\n{"ok":true}'
)


@pytest.fixture
async def api_url() -> AsyncIterator[str]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        writer.write(ANSWER)
        await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_a_content_type_with_obs_text_is_recorded(api_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    items = [{"id": "a", "method": "POST", "path": "/things", "body": {"n": 1}}]
    summary = await run_batch(items, out, BatchOptions(target=api_url, timeout=5.0))
    assert summary.complete and summary.done == 1
    line = out.read_bytes()
    record = json.loads(line.decode("utf-8"))  # strict: valid UTF-8, no lone surrogate
    assert record["status"] == 201 and record["body"] == {"ok": True}
    # The byte that is not UTF-8 is shown as U+FFFD: the media type, which the record is for,
    # is ASCII and kept.
    assert record["content_type"] == "application/json; note=caf\ufffd"
