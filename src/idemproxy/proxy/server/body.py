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
from typing import BinaryIO

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from idemproxy.errors import BodyInvalid, BodyTooLarge, ClientDisconnected, RequestTimeout
from idemproxy.identity.fingerprint import reencoding
from idemproxy.identity.reencoded import Digest

_CHUNK = 64 * 1024


class RequestBody:
    def __init__(
        self,
        *,
        memory: bytes = b"",
        spool: BinaryIO | None = None,
        size: int = 0,
        raw_sha256: bytes = b"",
        form_sha256: bytes | None = None,
        form_media_type: str | None = None,
    ) -> None:
        # The body itself while it is held in memory; None once it is in a file, so that no
        # caller can take a spooled body for an empty one. Attributes, not properties: every
        # governed request reads them once or twice.
        self.memory: bytes | None = memory if spool is None else None
        self._spool = spool
        self.spooled = spool is not None
        self.size = size if spool is not None else len(memory)
        self.raw_sha256 = raw_sha256
        # A spooled body its client may encode anew for each try, hashed as the fingerprint
        # takes it (identity/fingerprint.py `reencoding`), with the media type it hashes then.
        self.form_sha256, self.form_media_type = form_sha256, form_media_type
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
        return _buffered(request, data, limit, spool_threshold)
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


def _buffered(request: web.Request, data: bytes, limit: int, spool_threshold: int) -> RequestBody:
    """A body read whole: the same limit (a chunked one declared none) and spooling rules."""
    if len(data) > limit:
        raise BodyTooLarge()
    if len(data) <= spool_threshold:
        return RequestBody(memory=data)
    # Spooled even though it is in memory now: the attempts hold it for as long as they run.
    spool = _Spool(request)
    try:
        spool.write(data)
        return spool.body(len(data))
    except BaseException:
        spool.file.close()
        raise


async def _receive(request: web.Request, limit: int, spool_threshold: int) -> RequestBody:
    chunks: list[bytes] = []
    size = 0
    spool: _Spool | None = None
    try:
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge()
            if spool is None and size > spool_threshold:
                spool = _Spool(request)
                for held in chunks:
                    spool.write(held)
                chunks = []
            if spool is not None:
                spool.write(chunk)
            else:
                chunks.append(chunk)
        if spool is None:
            return RequestBody(memory=b"".join(chunks))
        return spool.body(size)
    except BaseException:
        if spool is not None:
            spool.file.close()
        raise


class _Spool:
    """A body going to disk, hashed as it is written: as it arrived (what an attempt sends,
    named in its evidence) and, for a body its client may encode anew, as the fingerprint
    takes it (SPEC §6)."""

    def __init__(self, request: web.Request) -> None:
        self.file: BinaryIO = tempfile.TemporaryFile()  # noqa: SIM115 - closed by RequestBody
        self._raw = hashlib.sha256()
        headers = request.headers
        encoding = ",".join(headers.getall(hdrs.CONTENT_ENCODING, ()))
        self._form: Digest | None = None
        self._form_media_type: str | None = None
        if form := reencoding(headers.get(hdrs.CONTENT_TYPE), encoding):
            self._form, self._form_media_type = form

    def write(self, chunk: bytes) -> None:
        self._raw.update(chunk)
        if self._form is not None:
            self._form.update(chunk)
        self.file.write(chunk)

    def body(self, size: int) -> RequestBody:
        self.file.flush()
        return RequestBody(
            spool=self.file,
            size=size,
            raw_sha256=self._raw.digest(),
            form_sha256=None if self._form is None else self._form.digest(),
            form_media_type=self._form_media_type,
        )
