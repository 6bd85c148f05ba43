"""The request fingerprint (SPEC §6): SHA-256 over method, path, query, media type and body."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from idemproxy.errors import ConfigError

_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")


def fingerprint(
    method: str,
    path: str,
    query: str,
    content_type: str | None,
    body: bytes,
    exclude_pointers: Sequence[str] = (),
) -> str:
    """A hex digest that is equal for requests with the same intent.

    JSON bodies are canonicalised (sorted keys, no insignificant whitespace) with the configured
    JSON pointers removed, so that semantically equal JSON matches. Every field is length-prefixed
    so that no two different requests can produce the same hashed byte stream.
    """
    digest = body_digest(content_type, body, exclude_pointers)
    return fingerprint_of_digest(method, path, query, content_type, digest)


def body_digest(
    content_type: str | None, body: bytes, exclude_pointers: Sequence[str] = ()
) -> bytes:
    if is_json(media_type_of(content_type)):
        body = canonical_json(body, exclude_pointers)
    return hashlib.sha256(body).digest()


def fingerprint_of_digest(
    method: str, path: str, query: str, content_type: str | None, body_sha256: bytes
) -> str:
    """The fingerprint from the SHA-256 of the (canonical) body. A body spooled to disk
    (proxy/body.py) is hashed as raw bytes while it arrives: it is not canonicalised."""
    media_type = media_type_of(content_type)
    digest = hashlib.sha256()
    for part in (method.upper().encode(), path.encode(), query.encode(), media_type.encode()):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    digest.update(body_sha256)
    return digest.hexdigest()


def media_type_of(content_type: str | None) -> str:
    if not content_type:
        return ""
    return content_type.split(";", 1)[0].strip().lower()


def is_json(media_type: str) -> bool:
    return media_type == "application/json" or media_type.endswith("+json")


def canonical_json(body: bytes, exclude_pointers: Sequence[str] = ()) -> bytes:
    """Canonical JSON bytes, or the body unchanged when it is not valid JSON.

    A document nested too deeply for the parser (RecursionError) counts as not valid JSON: it is
    fingerprinted as raw bytes instead of failing the request.
    """
    try:
        document = json.loads(body)
        for pointer in exclude_pointers:
            _remove(document, parse_pointer(pointer))
        canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return body
    return canonical.encode("utf-8", "surrogatepass")


def parse_pointer(pointer: str) -> list[str]:
    """RFC 6901 §3-§4: "/a/b~1c" → ["a", "b/c"]."""
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise ConfigError(f"JSON pointer {pointer!r} must start with '/'")
    return [token.replace("~1", "/").replace("~0", "~") for token in pointer[1:].split("/")]


def _remove(document: Any, tokens: list[str]) -> None:
    if not tokens:
        return
    parent = document
    for token in tokens[:-1]:
        parent = _child(parent, token)
        if parent is None:
            return
    last = tokens[-1]
    if isinstance(parent, dict):
        parent.pop(last, None)
    elif isinstance(parent, list) and (index := _array_index(last, parent)) is not None:
        parent[index] = None  # keep the positions of the other elements


def _child(node: Any, token: str) -> Any:
    if isinstance(node, dict):
        return node.get(token)
    if isinstance(node, list) and (index := _array_index(token, node)) is not None:
        return node[index]
    return None


def _array_index(token: str, array: list[Any]) -> int | None:
    """RFC 6901 §4: an array index is "0" or ASCII digits without a leading zero."""
    if not _ARRAY_INDEX.fullmatch(token):
        return None
    index = int(token)
    return index if index < len(array) else None
