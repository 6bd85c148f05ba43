"""Reading a governed request's body, bounded in size and time (SPEC §2.1, §9).

Bodies up to `server.spool_threshold` stay in memory; larger ones go to an unnamed temporary
file as they arrive (as nginx does), so that a hundred 10 MiB uploads do not cost a gigabyte of
memory. Every attempt reads the file with positioned reads, so that racing attempts (hedging)
never disturb each other.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import tempfile
import weakref
from collections.abc import AsyncIterator
from typing import BinaryIO

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from idemproxy.errors import BodyInvalid, BodyTooLarge, ClientDisconnected, RequestTimeout
from idemproxy.identity.fingerprint import Reencoding, reencoding
from idemproxy.identity.reencoded import Body

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

    def digest_by(self, form: Reencoding) -> bytes | None:
        """`form`'s digest of the spooled file, mapped into memory (run on a thread)."""
        if self._spool is None:
            raise ValueError("the body is held in memory")
        with mmap.mmap(self._spool.fileno(), self.size, access=mmap.ACCESS_READ) as mapped:
            mapped_body: Body = mapped
            return form.digest(mapped_body)

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
        return await _as_formed(request, _buffered(data, limit, spool_threshold))
    try:
        async with asyncio.timeout(timeout):
            body = await _receive(request, limit, spool_threshold)
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
    return body if body.memory is not None else await _as_formed(request, body)


def _buffered(data: bytes, limit: int, spool_threshold: int) -> RequestBody:
    """A body read whole: the same limit (a chunked one declared none) and spooling rules."""
    if len(data) > limit:
        raise BodyTooLarge()
    if len(data) <= spool_threshold:
        return RequestBody(memory=data)
    # Spooled even though it is in memory now: the attempts hold it for as long as they run.
    spool = _Spool()
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
                spool = _Spool()
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
    """A body going to disk, hashed as it arrives: what an attempt sends, named in its
    evidence, and what the fingerprint of a body hashed as sent takes."""

    def __init__(self) -> None:
        self.file: BinaryIO = tempfile.TemporaryFile()  # noqa: SIM115 - closed by RequestBody
        self._raw = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self._raw.update(chunk)
        self.file.write(chunk)

    def body(self, size: int) -> RequestBody:
        self.file.flush()
        return RequestBody(spool=self.file, size=size, raw_sha256=self._raw.digest())


async def _as_formed(request: web.Request, body: RequestBody) -> RequestBody:
    """A spooled body its client may encode anew for each try, with its digest as the
    fingerprint takes it (SPEC §6), worked out on a thread over the file mapped into memory:
    a body of megabytes, read whole once more."""
    headers = request.headers
    encoding = ",".join(headers.getall(hdrs.CONTENT_ENCODING, ()))
    form = reencoding(headers.get(hdrs.CONTENT_TYPE), encoding)
    if form is not None:
        digest = await asyncio.to_thread(body.digest_by, form)
        if digest is not None:
            body.form_sha256, body.form_media_type = digest, form.media_type
    return body
