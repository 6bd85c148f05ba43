"""Response heads as the client gets them: every header byte the upstream sent (SPEC §7, §10).

Header values are text in the proxy as aiohttp makes them of a request's bytes, and as
proxy/upstream/h1.py makes them of an upstream's: UTF-8, with each byte that is not part of a UTF-8
sequence kept as a surrogate escape (`errors="surrogateescape"`). aiohttp's own serializer
encodes plain UTF-8: its C version silently leaves the escapes out (`X-Name: caf\\xe9` reached
the client as `X-Name: caf`), its Python version raises. RFC 9110 §5.5 allows obs-text
(0x80-0xFF) in a field value, and ISO-8859-1 servlet containers send it; so every response of
the proxy's listener is serialised here, with the codec the bytes were decoded with. A head that
is all ASCII (nearly all of them) still goes through aiohttp's serializer: the same bytes.

Private aiohttp surface used here: `http_writer._serialize_headers`, `StreamWriter._write` and
the two fields that `StreamWriter.write_headers` sets since 3.12 (`_headers_buf`,
`_headers_written`); the byte-fidelity tests (tests/proxy/test_header_bytes.py) would fail were
they renamed.
"""

from __future__ import annotations

import re

from aiohttp.http_writer import StreamWriter, _serialize_headers
from multidict import CIMultiDict

# Since aiohttp 3.12 the writer holds the head back to send it with the first body bytes.
_HELD_BACK = hasattr(StreamWriter, "send_headers")
# RFC 9110 §5.5, RFC 9112 §4: what aiohttp's serializer refuses in a status line or field (a
# response split into two by a CR or LF of a value).
_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def serialise_head(status_line: str, headers: CIMultiDict[str]) -> bytes:
    """The status line and header fields, each value as the bytes it was decoded from."""
    if status_line.isascii() and all(n.isascii() and v.isascii() for n, v in headers.items()):
        return _serialize_headers(status_line, headers)
    lines = [status_line, *[f"{name}: {value}" for name, value in headers.items()]]
    for line in lines:
        if _FORBIDDEN.search(line) is not None:
            # aiohttp's own words, so that both paths fail alike.
            raise ValueError(
                "Forbidden control character detected in headers. "
                "Potential header injection attack."
            )
    lines.append("\r\n")
    return "\r\n".join(lines).encode("utf-8", "surrogateescape")


class HeadWriter(StreamWriter):
    """aiohttp's payload writer, with the head serialised by `serialise_head`."""

    async def write_headers(self, status_line: str, headers: CIMultiDict[str]) -> None:
        # As StreamWriter.write_headers: the head waits in the buffer for the first body bytes,
        # or until `send_headers`.
        if self._on_headers_sent is not None:
            await self._on_headers_sent(headers)
        head = serialise_head(status_line, headers)
        if not _HELD_BACK:
            self._write(head)  # aiohttp before 3.12 wrote it at once
            return
        self._headers_written = False
        self._headers_buf = head
