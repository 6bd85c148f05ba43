"""HTTP/1.1 on a plain socket, as bytes: what a client sends and what a server answers.

The fidelity suite compares answers field by field as they were on the wire: names in their
case, in their order, repeated ones repeated (RFC 9110 §5.3: the order of repeated fields is
significant). A client library would fold all of that away, so requests are written here as
bytes and answers parsed here by their own framing only (RFC 9112 §6.3).

`Tap` is the same for a client that cannot be replaced (boto3): a relay on a loopback port
that keeps every byte the server answered, in order, for `answers()` to parse.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

_STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})(?: [^\r\n]*)?")
_NO_BODY = frozenset({204, 304})
TIMEOUT = 15.0  # seconds for one exchange: a server that says nothing fails the test


@dataclass(frozen=True)
class Answer:
    """One response as it arrived: status line, fields in order (name case kept), body
    (chunked framing removed: the bytes the framing carried)."""

    status_line: bytes
    fields: tuple[tuple[bytes, bytes], ...]
    body: bytes
    chunked: bool

    @property
    def status(self) -> int:
        match = _STATUS_LINE.fullmatch(self.status_line)
        assert match is not None, self.status_line
        return int(match.group(1))

    def values(self, name: str) -> list[bytes]:
        wanted = name.lower().encode("ascii")
        return [value for field, value in self.fields if field.lower() == wanted]

    def value(self, name: str) -> str:
        """The one value of `name` (fails unless it is there exactly once)."""
        values = self.values(name)
        assert len(values) == 1, f"{name}: {values} in {self.describe()}"
        return values[0].decode("latin-1")

    def describe(self) -> str:
        head = b"\r\n".join([self.status_line, *(n + b": " + v for n, v in self.fields)])
        return f"{head.decode('latin-1')}\n\n{self.body[:300]!r}"


def request(
    method: str,
    target: str,
    host: str,
    fields: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
) -> bytes:
    """A request's bytes: the target as given (never normalised), `Host` first, then `fields`
    in order, then `Content-Length` when there is a body or the method expects one."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in fields]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def exchange(port: int, data: bytes, *, method: str = "GET") -> Answer:
    """Send `data` on a new connection to 127.0.0.1:`port`; the one answer to it."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(data)
        reader = _Reader(sock)
        return read_answer(reader, method)


class _Reader:
    """Bytes from a socket, or from a recording (`sock` None), read as far as asked."""

    def __init__(self, sock: socket.socket | None, data: bytes = b"") -> None:
        self._sock = sock
        self._buffer = bytearray(data)

    def until(self, marker: bytes) -> bytes:
        while (end := self._buffer.find(marker)) < 0:
            self._fill()
        return self._take(end + len(marker))

    def exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._fill()
        return self._take(size)

    def rest(self) -> bytes:
        with contextlib.suppress(EOFError):
            while True:
                self._fill()
        return self._take(len(self._buffer))

    def at_end(self) -> bool:
        return self._sock is None and not self._buffer

    def _take(self, size: int) -> bytes:
        taken = bytes(self._buffer[:size])
        del self._buffer[:size]
        return taken

    def _fill(self) -> None:
        chunk = self._sock.recv(65536) if self._sock is not None else b""
        if not chunk:
            raise EOFError(f"the connection ended inside an answer: {bytes(self._buffer)!r}")
        self._buffer += chunk


def read_answer(reader: _Reader, method: str) -> Answer:
    head = reader.until(b"\r\n\r\n")
    status_line, *lines = head[:-4].split(b"\r\n")
    match = _STATUS_LINE.fullmatch(status_line)
    assert match is not None, f"not a status line: {head[:200]!r}"
    fields = tuple(_field(line) for line in lines)
    answer = Answer(status_line, fields, b"", chunked=False)
    if int(match.group(1)) < 200:  # RFC 9110 §15.2: interim; the final answer follows
        return read_answer(reader, method)
    if method == "HEAD" or answer.status in _NO_BODY:
        return answer
    if any(v.strip().lower() == b"chunked" for v in answer.values("Transfer-Encoding")):
        return Answer(status_line, fields, _chunked(reader), chunked=True)
    lengths = answer.values("Content-Length")
    if lengths:
        assert len(lengths) == 1, f"Content-Length repeated: {lengths}"
        return Answer(status_line, fields, reader.exactly(int(lengths[0])), chunked=False)
    return Answer(status_line, fields, reader.rest(), chunked=False)  # RFC 9112 §6.3: to close


def _field(line: bytes) -> tuple[bytes, bytes]:
    name, colon, value = line.partition(b":")
    assert colon and name and name == name.strip(), f"not a field line: {line!r}"
    return name, value.strip(b" \t")


def _chunked(reader: _Reader) -> bytes:
    body = bytearray()
    while size := int(reader.until(b"\r\n").split(b";", 1)[0].strip(), 16):
        body += reader.exactly(size)
        assert reader.exactly(2) == b"\r\n", "a chunk not ended by CRLF"
    assert reader.until(b"\r\n") == b"\r\n", "trailer fields are not expected"
    return bytes(body)


class Tap:
    """A relay on a free loopback port to 127.0.0.1:`target`: it keeps every byte the target
    answered, connection by connection, before passing it on (so a client that has its answer
    finds it recorded)."""

    def __init__(self, target: int) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._streams: list[bytearray] = []
        self._threads: list[threading.Thread] = []
        self._open: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def answers(self, methods: Sequence[str]) -> list[Answer]:
        """Every answer recorded since the last call, one per method in `methods` (the requests'
        methods in the order they were sent), and nothing more."""
        with self._lock:
            streams = [bytes(s) for s in self._streams]
            for stream in self._streams:
                stream.clear()
        readers = [_Reader(None, data) for data in streams if data]
        answers: list[Answer] = []
        pending = iter(methods)
        for reader in readers:
            while not reader.at_end():
                answers.append(read_answer(reader, next(pending, "GET")))
        assert len(answers) == len(methods), f"{len(answers)} answers to {len(methods)} requests"
        return answers

    def close(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone would not (Linux).
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for thread in [self._accepting, *self._threads]:
            thread.join(timeout=5)
        for sock in self._open:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # shut down by close()
                return
            server = socket.create_connection(("127.0.0.1", self._target), timeout=TIMEOUT)
            server.settimeout(None)  # an idle keep-alive connection stays open, as without a tap
            stream = bytearray()
            with self._lock:
                self._streams.append(stream)
                self._open += [client, server]
            for source, sink, keep in ((client, server, None), (server, client, stream)):
                thread = threading.Thread(target=self._pump, args=(source, sink, keep))
                thread.start()
                self._threads.append(thread)

    def _pump(self, source: socket.socket, sink: socket.socket, keep: bytearray | None) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                if keep is not None:
                    with self._lock:
                        keep += chunk
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def tapped(target: int) -> Iterator[Tap]:
    tap = Tap(target)
    try:
        yield tap
    finally:
        tap.close()
