"""Each item's identity: a hash of its request and a deterministic Idempotency-Key (SPEC §4, §14).

The key is `PREFIX:ID:HASH` — the prefix names the run, the id the item, and the first
`KEY_HASH_LENGTH` hex digits of the request hash the exact intent. The same item gets the same
key on every run, so a retry or a resume after a crash is answered by the proxy from the job of
the first attempt instead of executing again. An edited item (other method, path, headers or
body) gets another key: it is a different intent (SPEC §1), never a replay of the old answer.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from idemproxy.batch.constants import KEY_HASH_LENGTH, KEY_ID_MAX_LENGTH, KEY_PREFIX_MAX_LENGTH
from idemproxy.batch.input import Item

# Ids made of these go into the key as they are, readable in `idemproxy jobs list`; any other
# id goes in as "~" and a hash, so that the key is always a valid bare token (SPEC §4).
_SAFE_ID = re.compile(rf"[A-Za-z0-9._@+=-]{{1,{KEY_ID_MAX_LENGTH}}}")
# SPEC §4: visible ASCII; a bare key may not contain quotes, commas or backslashes.
_SAFE_PREFIX = re.compile(rf"[!#-+\--\[\]-~]{{1,{KEY_PREFIX_MAX_LENGTH}}}")


@dataclass(frozen=True)
class Identity:
    request_hash: str  # sha256 hex of what is sent for the item
    key: str


def check_prefix(prefix: str) -> str:
    if not _SAFE_PREFIX.fullmatch(prefix):
        raise ValueError(
            f"key prefix must be 1-{KEY_PREFIX_MAX_LENGTH} visible ASCII characters "
            "without quotes, commas or backslashes"
        )
    return prefix


def identify(item: Item, prefix: str) -> Identity:
    digest = request_hash(item)
    return Identity(digest, f"{prefix}:{_id_part(item.id)}:{digest[:KEY_HASH_LENGTH]}")


def prefix_of(key: str, item_id: str) -> str:
    """The prefix a key was made with (the inverse of `identify` for that item's id)."""
    suffix_length = len(_id_part(item_id)) + KEY_HASH_LENGTH + 2
    return key[:-suffix_length] if len(key) > suffix_length else key


def request_hash(item: Item) -> str:
    """SHA-256 over what defines the intent: method, path, the item's headers and its body.

    Headers given on the command line (credentials) are not part of it, and neither is the
    target, so rotating an API key or moving the proxy does not turn old items into new intents.
    """
    body, content_type = item.payload()
    canonical = {
        "method": item.method,
        "path": item.path,
        "headers": sorted([name.lower(), value] for name, value in item.headers),
        "content_type": content_type,
        "body": None if body is None else hashlib.sha256(body).hexdigest(),
    }
    encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()


def _id_part(item_id: str) -> str:
    if _SAFE_ID.fullmatch(item_id):
        return item_id
    return "~" + hashlib.sha256(item_id.encode()).hexdigest()[:32]
