"""Sealing stored responses with AES-256-GCM, bound to their job (SPEC §11, encryption). Pure.

The box is a random 96-bit nonce and the ciphertext of the response's headers and body (with
GCM's tag). Its associated data is the job's owner, key and id, and the status and omitted flag
kept in the clear beside it: a box copied onto another job, another owner's row or a changed
status fails to open, as does one with a byte flipped. Nothing is ever opened without that
check, so a row that does not open is refused (`ResponseUnreadable`), never replayed as it is.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag

from idemproxy.core.types import Job, KeptResponse, SealedResponse, StoredResponse
from idemproxy.errors import ResponseUnreadable
from idemproxy.store.base import missing_key
from idemproxy.store.rows import decode_headers, encode_headers
from idemproxy.store.seal.keyring import KeyRing

NONCE_BYTES = 12  # NIST SP 800-38D §8.2.2: random 96-bit nonces, far below 2^32 per key
_PLAIN_FORMAT = b"1"
_AAD_PREFIX = b"idemproxy/response/1\x00"


class ResponseCodec:
    """Seals with the ring's primary key, opens with any key of the ring; with no ring (at
    rest in the clear), seals nothing and refuses every sealed response. With
    `require_sealed`, a response in the clear is refused too (SPEC §11): someone who can write
    to the database cannot plant one to be replayed."""

    __slots__ = ("_require_sealed", "_ring")

    def __init__(self, ring: KeyRing | None, *, require_sealed: bool = False) -> None:
        self._ring = ring
        self._require_sealed = require_sealed

    def holds(self, key_id: str) -> bool:
        """Whether the ring has the key `key_id`."""
        return self._ring is not None and key_id in self._ring.ciphers

    @property
    def primary(self) -> str | None:
        return None if self._ring is None else self._ring.primary

    def seal(self, job: Job, response: KeptResponse) -> KeptResponse:
        """`response` sealed under the primary key for `job`; as it is without a ring, or when
        it is sealed already."""
        ring = self._ring
        if ring is None or isinstance(response, SealedResponse):
            return response
        headers = encode_headers(response.headers).encode("ascii")  # ASCII JSON, no newline
        plain = b"".join((_PLAIN_FORMAT, headers, b"\n", response.body or b""))
        nonce = os.urandom(NONCE_BYTES)
        aad = associated_data(job, response.status, response.omitted)
        box = nonce + ring.ciphers[ring.primary].encrypt(nonce, plain, aad)
        return SealedResponse(response.status, response.omitted, ring.primary, box)

    def open(self, job: Job, response: KeptResponse) -> StoredResponse:
        """The response in the clear; `ResponseUnreadable` when its key is not in the ring or
        the box does not belong to this job as it is stored (moved, altered), or when it is in
        the clear and `require_sealed` is on."""
        if isinstance(response, StoredResponse) and self._require_sealed:
            raise ResponseUnreadable(_in_the_clear(job))
        return self._open(job, response)

    def _open(self, job: Job, response: KeptResponse) -> StoredResponse:
        if isinstance(response, StoredResponse):
            return response
        cipher = None if self._ring is None else self._ring.ciphers.get(response.key_id)
        if cipher is None:
            raise ResponseUnreadable(missing_key(job, response.key_id))
        box = response.sealed
        aad = associated_data(job, response.status, response.omitted)
        try:
            plain = cipher.decrypt(box[:NONCE_BYTES], box[NONCE_BYTES:], aad)
        except (InvalidTag, ValueError) as exc:
            raise ResponseUnreadable(_altered(job)) from exc
        return _response(job, response, plain)

    def reseal(self, job: Job, response: KeptResponse) -> SealedResponse | None:
        """`response` sealed under the primary key, or None when it is already."""
        if isinstance(response, SealedResponse) and response.key_id == self.primary:
            return None
        # A response in the clear is what a reseal exists to seal, unless `require_sealed` is
        # on: then no proxy wrote it (it was planted, or kept from before the switch-over), and
        # sealing it would make it replayable (SPEC §11). `open` refuses it.
        sealed = self.seal(job, self.open(job, response))
        return sealed if isinstance(sealed, SealedResponse) else None


def associated_data(job: Job, status: int, omitted: bool) -> bytes:
    # Length-prefixed, so that no two identities give the same bytes (a key may hold any
    # visible character, `|` and `:` included); an f-string costs a fraction of json.dumps on
    # every replay.
    owner, key, job_id = job.owner, job.key, job.id
    identity = f"{len(owner)}:{owner}|{len(key)}:{key}|{len(job_id)}:{job_id}|{status}|{omitted:d}"
    return _AAD_PREFIX + identity.encode("utf-8", "surrogateescape")


def _altered(job: Job) -> str:
    return (
        f"The stored response of job {job.id} does not open: it was altered or moved from "
        "another job; the request was not forwarded."
    )


def _in_the_clear(job: Job) -> str:
    return (
        f"The stored response of job {job.id} is in the clear, and encryption.require_sealed "
        "refuses every response not sealed; the request was not forwarded."
    )


def _response(job: Job, sealed: SealedResponse, plain: bytes) -> StoredResponse:
    head, sep, body = plain[len(_PLAIN_FORMAT) :].partition(b"\n")
    if not plain.startswith(_PLAIN_FORMAT) or not sep:
        raise ResponseUnreadable(_altered(job))
    # Parsed through the rows' cache of header lists: every replay of a job opens the same ones.
    headers = decode_headers(head.decode("ascii"))
    return StoredResponse(sealed.status, headers, None if sealed.omitted else body)


_TAG_PREFIX = b"idemproxy/redis-entry/1\x00"


class EntryTags:
    """Tags a replay cache's entry under the ring's primary key and checks a tag under any key
    of the ring (SPEC §11): GMAC, AES-GCM over no plaintext with the entry as associated data.
    The sealed box binds a response to its job, but an entry's other fields (its fingerprint,
    expiry, version) sit in the clear beside it; tagged, a changed field makes the entry a
    miss, so that whoever writes to Redis cannot make a retry with another payload replay the
    response or keep an entry past its expiry."""

    __slots__ = ("_ring",)

    def __init__(self, ring: KeyRing) -> None:
        self._ring = ring

    def tag(self, data: bytes) -> tuple[str, bytes]:
        """The primary key's id and the tag of `data` (a nonce and GCM's tag)."""
        ring = self._ring
        nonce = os.urandom(NONCE_BYTES)
        return ring.primary, nonce + ring.ciphers[ring.primary].encrypt(
            nonce, b"", _TAG_PREFIX + data
        )

    def checks(self, key_id: str, data: bytes, tag: bytes) -> bool:
        """Whether `tag` is the tag of `data` under the ring's key `key_id`."""
        cipher = self._ring.ciphers.get(key_id)
        if cipher is None or len(tag) <= NONCE_BYTES:
            return False
        try:
            cipher.decrypt(tag[:NONCE_BYTES], tag[NONCE_BYTES:], _TAG_PREFIX + data)
        except (InvalidTag, ValueError):
            return False
        return True
