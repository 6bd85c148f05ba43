"""Writing a streamed response to the first client, who may hang up at any moment."""

from __future__ import annotations

from aiohttp import web


class ClientSink:
    """Writes to the first client, and keeps going quietly once it has hung up (SPEC §2: the
    client disconnecting must not stop the attempt from finishing and being stored)."""

    def __init__(self, request: web.Request, response: web.StreamResponse) -> None:
        self._request = request
        self._response = response
        self.gone = False

    async def write(self, chunk: bytes) -> None:
        if self.gone:
            return
        try:
            if not self._response.prepared:
                await self._response.prepare(self._request)
            await self._response.write(chunk)
        except (ConnectionError, RuntimeError):
            self.gone = True

    async def finish(self) -> None:
        if not self.gone:
            await self.write(b"")
            try:
                await self._response.write_eof()
            except (ConnectionError, RuntimeError):
                self.gone = True

    def abort(self) -> None:
        abort(self._request, self._response)


def abort(request: web.Request, response: web.StreamResponse) -> None:
    """End a response cut off mid-body. The status line is out already: closing the connection
    is the only honest signal (RFC 9112 §8), and no other response may follow on it."""
    response.force_close()
    if request.transport is not None:
        request.transport.close()
