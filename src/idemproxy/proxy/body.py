"""Reading a governed request's body, bounded in size and time (SPEC §2.1, §9)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from idemproxy.errors import BodyTooLarge, RequestTimeout


async def read_body(request: web.Request, *, limit: int, timeout: float) -> bytes:
    """The whole body; 413 before any claim whether the length is declared or chunked."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyTooLarge()
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge()
                chunks.append(chunk)
    except TimeoutError as exc:
        raise RequestTimeout() from exc
    return b"".join(chunks)
