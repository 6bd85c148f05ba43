"""The request fingerprint (SPEC §6): SHA-256 over method, path, query, media type and body."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from idemproxy.constants import KEY_MAX_LENGTH
from idemproxy.errors import ConfigError, KeyInvalid
from idemproxy.identity import deep_json
from idemproxy.identity.reencoded import Body, gzip_digest, multipart_boundary, parts_digest
from idemproxy.randomness import RANDOM_128, refill

_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")
# One encoder for every body: `json.dumps` with any non-default option builds a new one per
# call. The output is the same byte for byte (stored fingerprints stay valid).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# What of a request's head the fingerprint hashes (SPEC §6): its method, path and query, and the
# two headers that say what its body is, `Content-Type` and `Content-Encoding`. A plain tuple,
# built on every governed request: a NamedTuple's constructor is a Python call of its own.
FingerprintedHead = tuple[str, str, str, str | None, str | None]


def fingerprint(head: FingerprintedHead, body: bytes, exclude_pointers: Sequence[str] = ()) -> str:
    """A hex digest that is equal for requests with the same intent.

    JSON bodies are canonicalised (sorted keys, no insignificant whitespace) with the configured
    JSON pointers removed, so that semantically equal JSON matches. Every field is length-prefixed
    so that no two different requests can produce the same hashed byte stream.
    """
    content_type, content_encoding = head[3], head[4]
    # `is_json(media_type_of(content_type))`, in place: every governed request's.
    media_type = content_type.split(";", 1)[0].strip().lower() if content_type else ""
    if content_encoding or media_type.startswith("multipart/"):
        form = reencoding(content_type, content_encoding)
        if form is not None and (digest := form.digest(body)) is not None:
            return fingerprint_of_digest(head, digest, form.media_type)
    if media_type == "application/json" or media_type.endswith("+json"):
        body = canonical_json(body, exclude_pointers)
    return fingerprint_of_digest(head, hashlib.sha256(body).digest())


@dataclass(frozen=True, slots=True)
class Reencoding:
    """How a body its client may encode anew for each try is hashed (identity/reencoded.py):
    `digest` of the body, None when the body does not qualify (then it is hashed as sent), and
    the media type the fingerprint then hashes (None: the usual one)."""

    digest: Callable[[Body], bytes | None]
    media_type: str | None = None


def reencoding(content_type: str | None, content_encoding: str | None) -> Reencoding | None:
    """None when a body of this head is hashed as sent (or canonicalised, for JSON).

    A `gzip` body (its only coding) is hashed without its time stamp. A multipart body without
    content coding, under one `boundary` RFC 2046 takes (and no RFC 2231 `boundary*`, which
    some parsers prefer), in a `Content-Type` whose parameters every parser reads alike
    (`_PLAIN_MULTIPART`), is hashed by its parts when it is strictly multipart, and its media
    type without the boundary, marked by a NUL that no normalised media type holds: no body
    hashed as sent under the same parameters can match it.
    """
    if content_encoding:
        return _GZIP if _codings(content_encoding) in _GZIP_CODINGS else None
    if not content_type or not _PLAIN_MULTIPART.fullmatch(content_type):
        return None
    media_type = content_type.split(";", 1)[0].strip().lower()
    parameters = _parameters(content_type.partition(";")[2]) or []
    names = [name for name, _ in parameters]
    if names.count("boundary") != 1 or any(name.startswith("boundary*") for name in names):
        return None
    boundary = multipart_boundary(dict(parameters)["boundary"])
    if boundary is None:
        return None
    others = "".join(f";{name}={_value_text(value)}" for name, value in parameters
                     if name != "boundary")  # fmt: skip
    return Reencoding(partial(parts_digest, boundary=boundary), f"{media_type}{others}\x00parts")


# RFC 9110 §8.4.1.3: `x-gzip` is `gzip`.
_GZIP_CODINGS = frozenset({"gzip", "x-gzip"})
_GZIP = Reencoding(gzip_digest)


def fingerprint_of_digest(
    head: FingerprintedHead, body_sha256: bytes, media_type: str | None = None
) -> str:
    """The fingerprint from the SHA-256 of the (canonical) body. A body spooled to disk
    (proxy/server/connection.py) is hashed as its bytes arrive: it is not canonicalised, but a body
    a client may encode anew is hashed as `reencoding` says, its `media_type` given with it.

    The body's content codings (`Content-Encoding`, RFC 9110 §8.4) change what the same bytes
    are to the backend (`gzip` is decoded, no coding is taken as it is): hashed as one more
    field, only when there is one, so that a request without it fingerprints as it always did.
    """
    method, path, query, content_type, content_encoding = head
    if media_type is None:
        if content_type and ";" not in content_type:
            media_type = content_type.strip().lower()  # `fingerprinted_media_type`, no parameters
        else:
            media_type = fingerprinted_media_type(content_type)
    fields = [method.upper(), path, query, media_type]
    if content_encoding and (codings := _codings(content_encoding)):
        fields.append(codings)
    stream = bytearray()  # hashed in one call: the same bytes as one update per part
    for text in fields:
        # Header values and targets hold any byte as a surrogate escape (aiohttp decodes them
        # so): hashed as the bytes that arrived, never an encoding error.
        part = text.encode("utf-8", "surrogateescape")
        stream += len(part).to_bytes(8, "big")
        stream += part
    stream += body_sha256
    return hashlib.sha256(stream).hexdigest()


def _codings(content_encoding: str | None) -> str:
    """`Content-Encoding` as a list of lower-cased codings (RFC 9110 §8.4.1: case-insensitive),
    in order (they were applied in that order), empty list elements dropped (§5.6.1)."""
    if not content_encoding:
        return ""
    return ",".join(c.strip(" \t").lower() for c in content_encoding.split(",") if c.strip(" \t"))


def media_type_of(content_type: str | None) -> str:
    """The media type without its parameters: what decides whether a body is JSON."""
    if not content_type:
        return ""
    return content_type.split(";", 1)[0].strip().lower()


def fingerprinted_media_type(content_type: str | None) -> str:
    """The media type with its parameters, as the fingerprint hashes it (SPEC §6).

    Parameters change what the same bytes mean (`boundary` splits a multipart body into other
    fields, `charset` decodes it to other text), so they are part of the intent. Normalised per
    RFC 9110 §8.3.1 and §5.6.6: type, subtype and parameter names lower-cased, values as sent but
    a quoted-string unquoted (re-quoted only when it is not a token) and a `charset` lower-cased
    (§8.3.2), in the order sent (a repeated name stays repeated, in its place), written
    `type/subtype;name=value`. A value without parameters (nor any after an empty `;`) is
    exactly what `media_type_of` gives, as before parameters were hashed: jobs stored by an
    older version still match their retries. A value that does not parse is hashed whole, as
    sent, after a NUL (which no normalised value holds), so it can match only itself.
    """
    if not content_type:
        return ""
    media_type = content_type.split(";", 1)[0].strip().lower()  # media_type_of
    if ";" not in content_type:
        return media_type
    parameters = _parameters(content_type.partition(";")[2])
    if parameters == []:
        return media_type
    if parameters is None or not _MEDIA_TYPE.fullmatch(media_type):
        return "\x00" + content_type.strip(" \t")
    return media_type + "".join(f";{name}={_value_text(value)}" for name, value in parameters)


_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"  # RFC 9110 §5.6.2
_MEDIA_TYPE = re.compile(f"{_TOKEN}/{_TOKEN}")
_TOKEN_ONLY = re.compile(_TOKEN)
# A multipart `Content-Type` every parser reads the same parameters from, as clients write it
# (`multipart/form-data; boundary=…`): each value letters, digits, `.`, `_` or `-`, bare or
# quoted, with no blank but one space after each `;`. Parsers differ on the rest: one
# unescapes `\z` in a quoted boundary and another does not, one splits a quoted value at its
# `;`, aiohttp strips blanks inside quotes and keeps a tab before `;`, Python's `email` decodes
# `utf-8''abc` and `=?utf-8?q?abc?=`; the proxy would then cut the body under another boundary
# than its backend.
_SAFE_VALUE = r'(?:[A-Za-z0-9._-]+|"[A-Za-z0-9._-]+")'
_PLAIN_MULTIPART = re.compile(
    rf"multipart/{_TOKEN}(?:; ?[A-Za-z0-9._-]+={_SAFE_VALUE})+", re.IGNORECASE
)
# RFC 9110 §5.6.6: `parameters = *( OWS ";" OWS [ parameter ] )`, `parameter = name "=" value`,
# a value a token or a quoted-string (qdtext: HTAB, SP and visible or obs-text bytes but `"` and
# `\`; a quoted-pair `\` escapes HTAB, SP, a visible character or obs-text).
_PARAMETER = re.compile(
    rf'[ \t]*;[ \t]*(?:({_TOKEN})=(?:({_TOKEN})|"((?:[\t !#-\[\]-~\x80-\U0010ffff]'
    rf'|\\[\t -~\x80-\U0010ffff])*)"))?'
)
_QUOTED_PAIR = re.compile(r"\\(.)", re.DOTALL)


def _parameters(text: str) -> list[tuple[str, str]] | None:
    """The (lower-cased name, unquoted value) pairs after the first `;`, or None when the text
    is not RFC 9110 parameters."""
    parameters: list[tuple[str, str]] = []
    position = 0
    text = ";" + text.rstrip(" \t")
    while position < len(text):
        match = _PARAMETER.match(text, position)
        if match is None or match.end() == position:
            return None
        name, token, quoted = match.groups()
        if name is not None:
            value = token if token is not None else _QUOTED_PAIR.sub(r"\1", quoted)
            name = name.lower()
            if name == "charset":  # RFC 9110 §8.3.2: charset names are case-insensitive
                value = value.lower()
            parameters.append((name, value))
        position = match.end()
    return parameters


def _value_text(value: str) -> str:
    """A value as a token when it is one, else as a quoted-string: `;` or `=` inside a value
    can never make two different parameter lists write the same text."""
    if _TOKEN_ONLY.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def is_json(media_type: str) -> bool:
    return media_type == "application/json" or media_type.endswith("+json")


def canonical_json(body: bytes, exclude_pointers: Sequence[str] = ()) -> bytes:
    """Canonical JSON bytes, or the body unchanged when it is not valid JSON.

    A document with a member name twice in an object counts as not valid JSON (RFC 8259 §4:
    which value counts is the parser's choice, so no canonical form can stand for it), and so
    does one with NaN or Infinity, which are not JSON. A document of any depth is canonicalised
    (identity/deep_json.py): one too deep for the C parser is no longer hashed as raw bytes, and
    is `BodyTooLarge` beyond `deep_json.MAX_DEEP_TEXT` (SPEC §9).
    """
    try:
        document = _document(body)
        for pointer in exclude_pointers:
            _remove(document, parse_pointer(pointer))
        canonical = _encode(document, len(body))
    except (UnicodeDecodeError, ValueError):
        return body
    try:
        return canonical.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, from an escape: written as the escape
        return _LONE_SURROGATE.sub(_escaped, canonical).encode("utf-8")


# RFC 8259 §7-§8: `"\ud800"` is valid JSON text but names no character; written raw it would be
# the bytes ED A0 80, which are no UTF-8, and which a body holding those very bytes (not JSON: it
# is hashed raw) would equal. Only strings hold such code points, so escaping them is exact.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _escaped(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def _document(body: bytes) -> Any:
    """The JSON value of a body; ValueError (UnicodeDecodeError is one) when it has none.

    SPEC §6, RFC 8259 §8.1: JSON text is UTF-8, without a byte order mark. A body in UTF-16 or
    UTF-32, or with a BOM, has none: a strict backend refuses what it would take in UTF-8, so
    the two must not fingerprint alike. Strict decoding also refuses the bytes of a lone
    surrogate (ED A0 80), which would otherwise be the same text as `"\ud800"`.
    """
    text = body.decode("utf-8")  # a BOM decodes to U+FEFF, which the decoder refuses
    # The integer -0 is the one integer token an int changes. A hook on every integer would
    # cost a call per token: only a body where the text may hold one (or a string that looks
    # so) pays it.
    negative_zero = "-0" in text and _NEGATIVE_ZERO.search(text)
    decoder = _WITH_NEGATIVE_ZERO if negative_zero else _DECODER
    try:
        return decoder.decode(text)
    except RecursionError:  # deeper than the C parser goes: the same values, without recursion
        return deep_json.loads(text, decoder)


def _parse_float(token: str) -> float | _Number:
    value = float(token)
    # The encoder writes a float as its repr: the same text only if the token was that repr.
    return value if repr(value) == token else _Number(token)


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")  # RFC 8259 §6


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    members = dict(pairs)
    if len(members) != len(pairs):
        raise ValueError("a member name occurs twice")
    return members


def _parse_int(token: str) -> int | _Number:
    return _Number(token) if token == "-0" else int(token)  # int("-0") is 0


# One decoder for every body, as for the encoder: `json.loads` with any hook builds one per call.
_DECODER = json.JSONDecoder(
    parse_float=_parse_float, parse_constant=_refuse_constant, object_pairs_hook=_unique_object
)
# With a hook on every integer, for the bodies that may hold the integer -0 (`_document`).
_WITH_NEGATIVE_ZERO = json.JSONDecoder(
    parse_float=_parse_float,
    parse_int=_parse_int,
    parse_constant=_refuse_constant,
    object_pairs_hook=_unique_object,
)
_NEGATIVE_ZERO = re.compile(r"-0(?![0-9.eE])")


class _Number(deep_json.Verbatim):
    """A number token that a float would change (`0.30000000000000000001` is 0.3, `1e400` and
    `9e999` are both infinite, `1E2` and `100.0` the same): kept as its text, so that different
    payloads never fingerprint the same."""

    __slots__ = ()


def _encode(document: Any, size: int) -> str:
    if size > _SLICED_ABOVE:  # deep_json.canonical: lets other threads run while it writes
        return deep_json.canonical(document, _CANONICAL, sliced=True)
    try:
        return _CANONICAL.encode(document)
    except (TypeError, RecursionError):  # a _Number, which the C encoder cannot write; depth
        return deep_json.canonical(document, _CANONICAL, sliced=True)


# The C encoder writes 64 KiB in about 5 ms (sys.getswitchinterval(): how long a thread may
# hold the interpreter before another may run), and a larger body in slices.
_SLICED_ABOVE = 64 * 1024


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


# Parsing and validating the Idempotency-Key header (SPEC §4).


_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]*")  # one C loop, not a Python one per character


def parse_key(values: Sequence[str]) -> str | None:
    """The normalised key from every value of the header, or None when it is absent.

    The RFC 8941 sf-string form (`"abc"`) and a bare token (`abc`) give the same key. More than one
    header line, a comma-joined list, or anything outside 1-255 visible ASCII is `key-invalid`.
    """
    if not values:
        return None
    if len(values) > 1:
        raise KeyInvalid("Send exactly one Idempotency-Key header.")
    raw = values[0].strip(" \t")
    if raw.startswith('"'):
        key = _unquote(raw)
    elif '"' in raw or "," in raw or "\\" in raw:
        raise KeyInvalid("A bare key may not contain quotes, commas or backslashes.")
    else:
        key = raw
    # `check_characters`'s tests, in place for a valid key; it says what is wrong otherwise.
    if not 1 <= len(key) <= KEY_MAX_LENGTH or _VISIBLE_ASCII.fullmatch(key) is None:
        check_characters(key)
    return key


def _unquote(raw: str) -> str:
    # RFC 8941 §3.3.3: DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE
    chars: list[str] = []
    escaped = False
    for index, char in enumerate(raw[1:], start=1):
        if escaped:
            if char not in '"\\':
                raise KeyInvalid('Only \\" and \\\\ may be escaped in a quoted key.')
            chars.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            if index != len(raw) - 1:
                raise KeyInvalid("A quoted key must be a single sf-string.")
            return "".join(chars)
        else:
            chars.append(char)
    raise KeyInvalid("The quoted key is not terminated.")


def check_characters(key: str) -> None:
    if not 1 <= len(key) <= KEY_MAX_LENGTH:
        raise KeyInvalid(f"The key must be 1-{KEY_MAX_LENGTH} characters long.")
    if _VISIBLE_ASCII.fullmatch(key) is None:
        raise KeyInvalid("The key may contain visible ASCII characters only.")


# Job ids: UUIDv7 (RFC 9562 §5.7), time-ordered.
#
# A random (v4) id lands on a random leaf of every index over it, so on a large store each new
# job read about one uncached index page per id index (bench/findings.md, store growth). A v7 id
# starts with the time in milliseconds: new ids land on the right-most leaves, which stay cached.
# The 74 bits after the time are random, so ids stay unguessable.


_TIME_BITS = (1 << 48) - 1
_RAND_A_BITS = (1 << 12) - 1
_RAND_B_BITS = (1 << 62) - 1


def new_job_id() -> str:
    millis = time.time_ns() // 1_000_000
    try:
        rand = RANDOM_128.pop() >> 48  # 80 bits, as many as the id has room for
    except IndexError:
        rand = refill() >> 48
    value = (
        (millis & _TIME_BITS) << 80
        | 0x7 << 76  # version 7
        | ((rand >> 62) & _RAND_A_BITS) << 64
        | 0b10 << 62  # the RFC 9562 variant
        | (rand & _RAND_B_BITS)
    )
    # The canonical 8-4-4-4-12 text, without building a uuid.UUID (twice as fast).
    digits = f"{value:032x}"
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"
