"""The one comparison of the fidelity suite: an answer through the proxy against the server's own.

Everything is compared as bytes: the status line, every field in its order with its name's case
and every repetition, and the body. The differences allowed are listed here, each with the
reason it is allowed; nothing else may differ. docs/reliability.md ("Fidelity against real
servers") lists the same, and any difference a server still shows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tests.fidelity.wire import Answer

# SPEC §10, RFC 9110 §7.6.1: hop-by-hop fields belong to one connection. Each leg has its own,
# and the proxy strips the upstream's and frames its own: not compared at all.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade"}
)
# RFC 9112 §6: how the body is delimited, not what it is. The proxy relays a chunked body as
# the identity body it decodes to (SPEC §10) and a replay recomputes Content-Length (SPEC §7):
# the bytes delivered are compared instead, and each side's framing must agree with them.
FRAMING = frozenset({b"transfer-encoding", b"content-length"})
# SPEC §7: a replay's Date is fresh (the answer is sent now), and any two answers of a server
# are made at different instants: only its presence and position are compared. On a replay not
# even its position: Date is not stored, and the fresh one follows the stored fields (RFC 9110
# §5.3: the order of fields with different names is not significant; docs/reliability.md).
DATE = b"date"
# SPEC §7: a replay says it is one, once; the first answer and the server's never carry it.
REPLAYED = b"idempotent-replayed"
# The proxy tells the client which job answered a governed request (the first answer and every
# replay: docs/reliability.md, "Identity and keys"), so that it can look the job up (SPEC §7.1,
# the admin API). One field, anywhere, the same id on the replay; never on a pass-through.
JOB = b"idempotency-job"


@dataclass(frozen=True)
class Volatile:
    """A value the server makes anew for every request (an id, a clock reading): it may differ
    between two requests the server executed, never between a first answer and its replay."""

    field: bytes | None  # a field whose value is masked (lower case), or
    body: re.Pattern[bytes] | None  # a pattern whose group 1 is masked in the body
    reason: str


def assert_same_as_server(
    server: Answer, proxied: Answer, volatile: Sequence[Volatile] = (), *, governed: bool
) -> None:
    """`proxied` (the first answer through the proxy to a `governed` request, or a pass-through)
    is the answer the server gave directly to the same request bytes."""
    _assert_framed(server)
    _assert_framed(proxied)
    where = f"\n--- server ---\n{server.describe()}\n--- proxy ---\n{proxied.describe()}"
    assert len(proxied.values("Idempotency-Job")) == (1 if governed else 0), where
    assert server.values("Idempotency-Job") == [], f"the server set it: {where}"
    proxied = _without(proxied, JOB)
    assert proxied.status_line == server.status_line, where
    masked = {v.field for v in volatile if v.field is not None} | {DATE}
    assert _comparable(proxied, masked) == _comparable(server, masked), where
    assert _masked_body(proxied, volatile) == _masked_body(server, volatile), where


def assert_replay_of(first: Answer, replay: Answer) -> None:
    """`replay` is the stored `first` answer again: only Date (value and position), the framing
    and `Idempotent-Replayed: true` (one field, anywhere) may differ; nothing volatile does."""
    _assert_framed(first)
    _assert_framed(replay)
    where = f"\n--- first ---\n{first.describe()}\n--- replay ---\n{replay.describe()}"
    assert first.values("Idempotent-Replayed") == [], where
    assert replay.values("Idempotent-Replayed") == [b"true"], where
    # SPEC §7, §10: the reason phrase as the first answer's, byte for byte.
    assert replay.status_line == first.status_line, where
    assert replay.values("Idempotency-Job") == first.values("Idempotency-Job"), where
    assert len(replay.values("Date")) == len(first.values("Date")) == 1, where
    trimmed = _without(replay, REPLAYED, JOB, DATE)
    assert _comparable(trimmed, set()) == _comparable(_without(first, JOB, DATE), set()), where
    assert replay.body == first.body, where


def _without(answer: Answer, *names: bytes) -> Answer:
    fields = tuple(f for f in answer.fields if f[0].lower() not in names)
    return Answer(answer.status_line, fields, answer.body, answer.chunked)


def _comparable(answer: Answer, masked: set[bytes]) -> list[tuple[bytes, bytes]]:
    """Fields in order, case kept, without the hop-by-hop and framing ones; masked values
    replaced by a placeholder (present, where it was, value not compared)."""
    kept = []
    for name, value in answer.fields:
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in FRAMING:
            continue
        kept.append((name, b"<masked>" if lower in masked else value))
    return kept


def _masked_body(answer: Answer, volatile: Sequence[Volatile]) -> bytes:
    body = answer.body
    for item in volatile:
        if item.body is not None:
            body = item.body.sub(lambda m: m.group(0).replace(m.group(1), b"<masked>"), body)
    return body


def _assert_framed(answer: Answer) -> None:
    """The framing fields agree with the bytes that arrived (RFC 9112 §6.3)."""
    lengths = answer.values("Content-Length")
    if answer.chunked:
        assert lengths == [], f"chunked with Content-Length: {answer.describe()}"
    elif lengths:
        assert lengths == [str(len(answer.body)).encode()], answer.describe()
