"""Redis cache entries for completed jobs: names and a compact encoding (SPEC §7, §11). Pure.

An entry holds everything a replay needs, so that a hit is answered without the store: the
job's id, version, fingerprint and expiry, and its stored response (status, header pairs in
order, body bytes, omitted flag), and the (owner, key) it belongs to, as a hash: an entry read
under another name is a miss. Layout: one format byte, a JSON line of metadata, then the
body bytes as they are (no base64). With encryption at rest (SPEC §11) the entry holds the
sealed box instead of the headers and body, under format `2`, which an older proxy reads as
a miss: Redis then holds no response in the clear; and every entry goes behind a tag of its
fields under the same key ring (format `3`, store/seal/codec.py `EntryTags`), so that one whose
fingerprint or expiry someone changed is a miss too. Entries are named by a hash of (owner,
key): the owner is already a hash of the credential (SPEC §5), and neither appears in Redis in
the clear.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import UTC, datetime
from typing import Any, Protocol

from idemproxy.constants import REDIS_GONE_PREFIX, REDIS_JOB_PREFIX, REDIS_WATCH_PREFIX
from idemproxy.core.types import Job, JobState, KeptResponse, SealedResponse, StoredResponse
from idemproxy.store.rows import pairs_from_json, pairs_to_json

_FORMAT = b"1"  # an entry of any other format is a miss, never an error
_SEALED_FORMAT = b"2"
# An entry of format 1 or 2 behind a tag under the key ring (store/seal/codec.py `EntryTags`):
# `3`, the tag's key id, `:`, the tag in hex, a newline, then the entry.
_TAGGED_FORMAT = b"3"


class Tags(Protocol):
    """How entries are tagged with encryption at rest (store/seal/codec.py `EntryTags`)."""

    def tag(self, data: bytes) -> tuple[str, bytes]: ...

    def checks(self, key_id: str, data: bytes, tag: bytes) -> bool: ...


def entry_name(owner: str, key: str) -> str:
    """`idemproxy:job:{<hash>}`: the braces keep an entry and its tombstones in one slot."""
    return f"{REDIS_JOB_PREFIX}{{{_scope(owner, key)}}}"


def _scope(owner: str, key: str) -> str:
    """What names an entry, and what the entry says it belongs to (`decode` compares them)."""
    return hashlib.sha256(json.dumps([owner, key]).encode()).hexdigest()  # unambiguous pair


def tombstone_name(entry: str, job_id: str) -> str:
    """Marks one deleted job: a cache write for it that lands later is refused."""
    return f"{REDIS_GONE_PREFIX}{entry.removeprefix(REDIS_JOB_PREFIX)}:{job_id}"


def watch_name(entry: str) -> str:
    """Set while a duplicate of (owner, key) is held somewhere: its changes are published."""
    return f"{REDIS_WATCH_PREFIX}{entry.removeprefix(REDIS_JOB_PREFIX)}"


def encode(job: Job, tags: Tags | None = None) -> bytes:
    """A completed job with its response and expiry (callers check both); with `tags`, behind
    a tag of its fields (all of an entry in the clear; a sealed one's box has its own)."""
    response = job.response
    assert response is not None and job.expires_at is not None, "only completed jobs are cached"
    meta = {
        "sc": _scope(job.owner, job.key),
        "id": job.id,
        "fp": job.fingerprint,
        "v": job.version,
        "n": job.attempt_count,
        "by": job.completed_by,
        "m": job.method,
        "p": job.path,
        "exp": job.expires_at.timestamp(),
        "s": response.status,
        "omit": response.omitted,
    }
    if isinstance(response, SealedResponse):
        meta["k"] = response.key_id
        form, body = _SEALED_FORMAT, response.sealed
    else:
        meta["h"] = pairs_to_json(response.headers)  # no lone surrogate (store/rows.py)
        form, body = _FORMAT, response.body or b""
    head = json.dumps(meta, separators=(",", ":")).encode()  # ASCII: never holds a newline
    entry = b"".join((form, head, b"\n", body))
    if tags is None:
        return entry
    key_id, tag = tags.tag(_tagged_part(entry, len(head)))
    return b"".join((_TAGGED_FORMAT, key_id.encode(), b":", tag.hex().encode(), b"\n", entry))


def _tagged_part(entry: bytes, head_length: int) -> bytes:
    """What an entry's tag covers: all of it in the clear; a sealed one's format byte and
    fields, its box being bound to its job by its own seal."""
    return entry[: 1 + head_length] if entry.startswith(_SEALED_FORMAT) else entry


def decode(payload: bytes, owner: str, key: str, tags: Tags | None = None) -> Job | None:
    """The job in an entry, or None for an entry this version cannot read: any other format,
    or one whose fields are not what `encode` writes (SPEC §11: a miss, never an error, and
    never a replay of what no upstream could have answered). With `tags` only a tagged entry
    whose tag holds is read; without, no tagged one is."""
    if tags is not None:
        untagged = _untagged(payload, tags)
        if untagged is None:
            return None
        payload = untagged
    if not payload.startswith((_FORMAT, _SEALED_FORMAT)):
        return None
    sealed = payload.startswith(_SEALED_FORMAT)
    head, sep, body = payload[1:].partition(b"\n")
    if not sep:
        return None
    try:
        meta = json.loads(head)
        if not isinstance(meta, dict):
            return None
        return _job(meta, (owner, key), body, sealed=sealed)
    except (ValueError, KeyError, TypeError, OverflowError, OSError):
        return None


def _untagged(payload: bytes, tags: Tags) -> bytes | None:
    """The entry behind a tag that holds, else None."""
    if not payload.startswith(_TAGGED_FORMAT):
        return None
    line, sep, entry = payload[1:].partition(b"\n")
    key_id, colon, tag_hex = line.partition(b":")
    head_length = entry.find(b"\n") - 1
    if not (sep and colon) or head_length < 0 or not _HEX.fullmatch(tag_hex):
        return None  # one spelling of a tag only, as `encode` writes it
    try:
        tag = bytes.fromhex(tag_hex.decode("ascii"))
        name = key_id.decode("ascii")
    except (UnicodeDecodeError, ValueError):
        return None
    return entry if tags.checks(name, _tagged_part(entry, head_length), tag) else None


def _job(meta: dict[str, Any], scope: tuple[str, str], body: bytes, *, sealed: bool) -> Job:
    owner, key = scope
    if _text(meta, "sc") != _scope(owner, key):
        # Another owner's or key's entry under this name (copied by someone who can write to
        # Redis), or one written before entries said whose they are: never replayed as this
        # key's; the store answers (SPEC §11, §5).
        raise ValueError("an entry of another scope")
    status, omitted = _integer(meta, "s"), meta["omit"]
    # A stored response is a final one (RFC 9110 §15): what an operator's resolution is held to.
    if not 200 <= status <= 599 or type(omitted) is not bool:
        raise ValueError("not a response this proxy stores")
    response: KeptResponse
    if sealed:
        response = SealedResponse(status, omitted, _text(meta, "k"), body)
    else:
        headers = pairs_from_json(_header_pairs(meta["h"]))
        response = StoredResponse(status, headers, None if omitted else body)
    completed_by = meta["by"]
    if completed_by is not None:
        completed_by = _integer(meta, "by")
    return Job(
        id=_text(meta, "id"),
        owner=owner,
        key=key,
        fingerprint=_text(meta, "fp"),
        state=JobState.COMPLETED,
        version=_integer(meta, "v"),
        attempt_count=_integer(meta, "n"),
        method=_text(meta, "m"),
        path=_text(meta, "p"),
        completed_by=completed_by,
        response=response,
        expires_at=datetime.fromtimestamp(_number(meta, "exp"), tz=UTC),
    )


def _header_pairs(value: Any) -> list[list[str]]:
    """Pairs as `encode` writes them (store/rows.py: a name and a value, and a mark when they
    hold bytes beyond ASCII), all strings, the name and value without a line break or NUL,
    which no field the proxy stores has (RFC 9110 §5.5) and no head could carry."""
    if type(value) is not list:
        raise TypeError("h")
    for pair in value:
        if type(pair) is not list or len(pair) not in (2, 3):
            raise TypeError("h")
        if any(type(part) is not str for part in pair):
            raise TypeError("h")
        if _FORBIDDEN.search(pair[0]) or _FORBIDDEN.search(pair[1]):
            raise ValueError("h")
    return value


_FORBIDDEN = re.compile("[\r\n\x00]")
_HEX = re.compile(rb"[0-9a-f]+")


def _integer(meta: dict[str, Any], name: str) -> int:
    value = meta[name]
    if type(value) is not int:  # not a bool, a float or a string of digits
        raise TypeError(name)
    return value


def _number(meta: dict[str, Any], name: str) -> float:
    value = meta[name]
    if type(value) not in (int, float) or not math.isfinite(value):
        raise TypeError(name)
    return float(value)


def _text(meta: dict[str, Any], name: str) -> str:
    value = meta[name]
    if type(value) is not str:
        raise TypeError(name)
    return value
