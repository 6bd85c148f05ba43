"""Reading a governed request's body, bounded in size and time (SPEC §2.1, §9).

Bodies up to `server.spool_threshold` stay in memory; larger ones go to an unnamed temporary
file as they arrive (as nginx does), so that a hundred 10 MiB uploads do not cost a gigabyte of
memory. Every attempt reads the file with positioned reads, so that racing attempts (hedging)
never disturb each other.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import weakref
from collections.abc import AsyncIterator
from typing import Any, BinaryIO

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from idemproxy.errors import BodyInvalid, BodyTooLarge, ClientDisconnected, RequestTimeout

_CHUNK = 64 * 1024


class RequestBody:
    def __init__(
        self,
        *,
        memory: bytes = b"",
        spool: BinaryIO | None = None,
        size: int = 0,
        raw_sha256: bytes = b"",
    ) -> None:
        # The body itself while it is held in memory; None once it is in a file, so that no
        # caller can take a spooled body for an empty one. Attributes, not properties: every
        # governed request reads them once or twice.
        self.memory: bytes | None = memory if spool is None else None
        self._spool = spool
        self.spooled = spool is not None
        self.size = size if spool is not None else len(memory)
        self.raw_sha256 = raw_sha256
        if spool is not None:
            # Closed (and so deleted) when the last attempt using it is done.
            weakref.finalize(self, spool.close)

    def held(self) -> bytes:
        """The body, where a route holds every body in memory (`in_memory` bodies)."""
        if self.memory is None:
            raise ValueError("the body is spooled to disk")
        return self.memory

    def reader(self) -> AsyncIterator[bytes]:
        """A fresh reader of the spooled file, for one attempt: what to send upstream when
        `memory` is None (racing attempts each read it with their own offsets)."""
        if self._spool is None:
            raise ValueError("the body is held in memory")
        return self._chunks(self._spool.fileno())

    async def _chunks(self, fd: int) -> AsyncIterator[bytes]:
        offset = 0
        while offset < self.size:
            data = os.pread(fd, min(_CHUNK, self.size - offset), offset)
            if not data:
                return
            offset += len(data)
            yield data


async def read_body(
    request: web.Request, *, limit: int, timeout: float, spool_threshold: int
) -> RequestBody:
    """The whole body; 413 before any claim whether the length is declared or chunked."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyTooLarge()
    content = request.content
    if content.is_eof():
        # The whole body is in aiohttp's buffer already (a small body arrives with its head):
        # nothing left to wait for, so no deadline to arm (SPEC §9) and one read takes it all.
        data = content.read_nowait()
        if len(data) <= limit and len(data) <= spool_threshold:  # `_buffered`'s common case
            return RequestBody(memory=data)
        return _buffered(data, limit, spool_threshold)
    try:
        async with asyncio.timeout(timeout):
            return await _receive(request, limit, spool_threshold)
    except TimeoutError as exc:
        raise RequestTimeout() from exc
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        # A chunk's framing broken in a later read (SPEC §8); aiohttp's Python parser hands
        # on some of its errors wrapped in RequestPayloadError.
        raise BodyInvalid() from exc
    except ConnectionResetError as exc:
        # A client hanging up mid-body is routine (and cheap to do on purpose): one line, not
        # aiohttp's traceback at ERROR (proxy/handler.py logs and counts it).
        raise ClientDisconnected() from exc


def _buffered(data: bytes, limit: int, spool_threshold: int) -> RequestBody:
    """A body read whole: the same limit (a chunked one declared none) and spooling rules."""
    if len(data) > limit:
        raise BodyTooLarge()
    if len(data) <= spool_threshold:
        return RequestBody(memory=data)
    # Spooled even though it is in memory now: the attempts hold it for as long as they run.
    spool = tempfile.TemporaryFile()  # noqa: SIM115 - closed by RequestBody
    digest = hashlib.sha256()
    try:
        _spill(spool, digest, data)
        spool.flush()
    except BaseException:
        spool.close()
        raise
    return RequestBody(spool=spool, size=len(data), raw_sha256=digest.digest())


async def _receive(request: web.Request, limit: int, spool_threshold: int) -> RequestBody:
    chunks: list[bytes] = []
    size = 0
    spool: BinaryIO | None = None
    digest: Any = None  # only a spooled body is hashed as it arrives
    try:
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge()
            if spool is None and size > spool_threshold:
                spool = tempfile.TemporaryFile()  # noqa: SIM115 - closed by RequestBody
                digest = hashlib.sha256()
                for held in chunks:
                    _spill(spool, digest, held)
                chunks = []
            if spool is not None:
                _spill(spool, digest, chunk)
            else:
                chunks.append(chunk)
    except BaseException:
        if spool is not None:
            spool.close()
        raise
    if spool is None:
        return RequestBody(memory=b"".join(chunks))
    spool.flush()
    return RequestBody(spool=spool, size=size, raw_sha256=digest.digest())


def _spill(spool: BinaryIO, digest: Any, chunk: bytes) -> None:
    digest.update(chunk)
    spool.write(chunk)
