"""What makes a request's intent (SPEC §4-§6): its Idempotency-Key, its owner and its
fingerprint, and the id of the job it creates; one module, entered once or twice per request.

The fingerprint is SHA-256 over method, path, query, media type and body.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, Protocol
from urllib.parse import parse_qsl, unquote, unquote_plus

from multidict import CIMultiDict, CIMultiDictProxy, MultiMapping

from idemproxy.config.settings import OwnerSettings, check_strategy
from idemproxy.constants import ANONYMOUS_OWNER, GLOBAL_OWNER, KEY_MAX_LENGTH
from idemproxy.errors import ConfigError, HeaderInvalid, KeyInvalid, OwnerMissing, OwnerUnstable
from idemproxy.identity import deep_json
from idemproxy.identity.jwt_keys import FetchObserver, KeySource, unobserved
from idemproxy.identity.jwt_owner import JwtVerifier
from idemproxy.identity.reencoded import Body, gzip_digest, multipart_boundary, parts_digest
from idemproxy.randomness import RANDOM_128, refill

_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")
# One encoder for every body: `json.dumps` with any non-default option builds a new one per
# call. The output is the same byte for byte (stored fingerprints stay valid).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# What of a request's head the fingerprint hashes (SPEC §6): its method, path and query, the two
# headers that say what its body is, `Content-Type` and `Content-Encoding`, and the values of
# `fingerprint_headers` it sent (`headers_field`; None when it sent none of them). A plain
# tuple, built on every governed request: a NamedTuple's constructor is a Python call of its own.
FingerprintedHead = tuple[str, str, str, str | None, str | None, str | None]


def headers_field(names: Sequence[str], headers: MultiMapping[str]) -> str:
    """The fingerprint's field for `fingerprint_headers` (lower-cased names, at least one): each
    one the request sent, its lines joined as RFC 9110 §5.3 combines them (`a` and `b` are
    `a, b`). A request that sends none of them has the field too, so that its jobs are told
    apart from those stored before the setting (`fingerprints`). A NUL, which no header holds,
    begins it and parts it: no content coding (the field before it, when there is one) can be
    the same text."""
    parts: list[str] = []
    for name in names:
        values = headers.getall(name, ())
        if values:
            parts += (name, ", ".join(values))
    return "\x00" + "\x00".join(parts)


def fingerprints(
    head: FingerprintedHead, body: bytes, exclude_pointers: Sequence[str] = ()
) -> tuple[str, str | None]:
    """`fingerprint`, and with a field of `fingerprint_headers` the fingerprint the request had
    without it, as before that setting: a job stored then matches it (SPEC §6). The body is
    hashed once."""
    return fingerprints_of_digest(head, *_hashed_body(head, body, exclude_pointers))


def fingerprints_of_digest(
    head: FingerprintedHead, body_sha256: bytes, media_type: str | None = None
) -> tuple[str, str | None]:
    """`fingerprints` of a body hashed as it arrived (`fingerprint_of_digest`)."""
    plain = None
    if head[5] is not None:
        plain = fingerprint_of_digest((*head[:5], None), body_sha256, media_type)
    return fingerprint_of_digest(head, body_sha256, media_type), plain


def fingerprint(head: FingerprintedHead, body: bytes, exclude_pointers: Sequence[str] = ()) -> str:
    """A hex digest that is equal for requests with the same intent.

    JSON bodies are canonicalised (sorted keys, no insignificant whitespace) with the configured
    JSON pointers removed, so that semantically equal JSON matches. Every field is length-prefixed
    so that no two different requests can produce the same hashed byte stream.
    """
    return fingerprint_of_digest(head, *_hashed_body(head, body, exclude_pointers))


def _hashed_body(
    head: FingerprintedHead, body: bytes, exclude_pointers: Sequence[str]
) -> tuple[bytes, str | None]:
    """The SHA-256 of the body as the fingerprint takes it, and the media type it is hashed
    under when not the head's (`fingerprint_of_digest`)."""
    content_type, content_encoding = head[3], head[4]
    # `is_json(media_type_of(content_type))`, in place: every governed request's.
    media_type = content_type.split(";", 1)[0].strip().lower() if content_type else ""
    if content_encoding or media_type.startswith("multipart/"):
        form = reencoding(content_type, content_encoding)
        if form is not None and (digest := form.digest(body)) is not None:
            return digest, form.media_type
    if media_type == "application/json" or media_type.endswith("+json"):
        body = canonical_json(body, exclude_pointers)
    return hashlib.sha256(body).digest(), None


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
    method, path, query, content_type, content_encoding, sent_headers = head
    if media_type is None:
        if content_type and ";" not in content_type:
            media_type = content_type.strip().lower()  # `fingerprinted_media_type`, no parameters
        else:
            media_type = fingerprinted_media_type(content_type)
    fields = [method.upper(), path, query, media_type]
    if content_encoding and (codings := _codings(content_encoding)):
        fields.append(codings)
    if sent_headers is not None:  # only then: a request without them hashes as it always did
        fields.append(sent_headers)
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


# Deriving the owner scope of a request (SPEC §5). Only a hash of a credential is kept: its
# SHA-256 (or, for a JWT, of its verified claim), and with `owner.pepper` set, the HMAC-SHA256 of
# that under the pepper, which a database dump alone does not let anyone recompute.


# RFC 9110 §11.4: `Authorization: <auth-scheme> [ token68 / #auth-param ]`. The schemes whose
# credentials are computed afresh for each request, by the name their specifications give them.
_SIGNED_SCHEMES: Final = {
    "aws4-hmac-sha256": "AWS Signature Version 4",
    "aws4-ecdsa-p256-sha256": "AWS Signature Version 4A",
    "aws": "AWS Signature Version 2",
    "goog4-hmac-sha256": "Google Cloud Storage V4 signature",
    "goog4-rsa-sha256": "Google Cloud Storage V4 signature",
    "goog1": "Google Cloud Storage HMAC signature",
    "oss": "Alibaba Cloud OSS signature",
    "oss4-hmac-sha256": "Alibaba Cloud OSS V4 signature",
    "tc3-hmac-sha256": "Tencent Cloud TC3 signature",
    "sharedkey": "Azure Storage Shared Key",
    "sharedkeylite": "Azure Storage Shared Key Lite",
    "hmac-sha256": "HMAC-SHA256 request signature (Azure, Volcengine)",
    "hmac-sha1": "HMAC-SHA1 request signature",
    "qiniu": "Qiniu signature",
    "qbox": "Qiniu QBox signature",
    "ksc": "Kingsoft Cloud signature",
    "kss": "Kingsoft Cloud KS3 signature",
    "eg1-hmac-sha256": "Akamai EdgeGrid",
    "digest": "HTTP Digest (RFC 7616)",
    "hawk": "Hawk",
    "oauth": "OAuth 1.0a (RFC 5849)",
    "signature": "HTTP Signatures (draft-cavage)",
    "hoba": "HOBA (RFC 7486)",
    "scram-sha-1": "SCRAM (RFC 7804)",
    "scram-sha-256": "SCRAM (RFC 7804)",
    "negotiate": "Negotiate (Kerberos, RFC 4559)",
    "ntlm": "NTLM",
    "obs": "Huawei Cloud OBS signature",
    "acs": "Alibaba Cloud ROA signature",
    "upyun": "UPYUN signature",
    "vws": "Vuforia Web Services signature",
    "apiauth": "api-auth HMAC signature",
}
# Credentials with no scheme before their first space, known by how they begin (the rest is
# the signature, never echoed): Baidu's BCE and Tencent COS's.
_SIGNED_PREFIXES: Final = {
    "bce-auth-v1/": "Baidu Cloud BCE signature (bce-auth-v1)",
    "q-sign-algorithm=": "Tencent Cloud COS signature (q-sign-algorithm)",
}
# Schemes whose credential is a token sent unchanged on every try: never second-guessed. An
# Azure Service Bus, Event Hubs or IoT Hub SAS token signs its resource and expiry (`sr`,
# `se`): the same token is sent until it expires, though it holds a `sig`.
_STABLE_SCHEMES: Final = frozenset(
    {"bearer", "basic", "token", "apikey", "api-key", "dpop", "sharedaccesssignature"}
)
# An auth-param with one of these names makes any other scheme a per-request signature (a MAC
# or a nonce: OAuth's MAC draft, vendors' HMAC schemes), wherever it is in the credential and
# whichever of the separators vendors use comes before it. A time alone (`date`, `ts`) does
# not: an API key may hold one, and a signature of a time has a MAC beside it.
_SIGNED_PARAM: Final = re.compile(
    r"(?:^|[\s,;&])(?:signature|q-signature|sig|mac|nonce|cnonce|oauth_signature|oauth_nonce)"
    r"\s*=",
    re.IGNORECASE,
)
# Azure Cosmos DB: `type={master|resource|aad}&ver=1.0&sig=…`, URL-encoded as its
# documentation requires or not. Only a master key's signs the request (its verb, resource
# and `x-ms-date`); a resource token or an Entra ID token is the same on every try.
_COSMOS_PARAMS: Final = frozenset({"type", "ver", "sig"})
# RFC 9421 §4: a message signature travels in these two fields, whatever else authenticates.
_MESSAGE_SIGNATURE: Final = ("Signature-Input", "Signature")
# Query parameters of a presigned URL: its signature is in the URL (SigV4 §"query string
# authentication", SigV2, GCS V4, Tencent COS).
_PRESIGNED: Final = {
    "x-amz-signature": "an AWS SigV4 presigned URL (X-Amz-Signature)",
    "x-goog-signature": "a Google Cloud Storage presigned URL (X-Goog-Signature)",
    "q-signature": "a Tencent Cloud COS presigned URL (q-signature)",
    "signature": "a presigned URL (Signature)",
}


def per_request_signature(
    authorization: str | None, headers: Mapping[str, str], raw_query: str = ""
) -> str | None:
    """What makes this request's credential a signature for this request alone, in words for
    a problem's detail; None when its credential is one that every try sends the same.

    With an `Authorization`, only it counts: a stable token next to an RFC 9421 signature
    scopes the request by that token. Without one, a message signature or a presigned URL is
    the credential, and neither is anything the proxy verified."""
    if authorization:
        return _signed_scheme(authorization)
    signature_input, signature = _MESSAGE_SIGNATURE
    if signature_input in headers and signature in headers:
        return "HTTP Message Signatures (RFC 9421: Signature-Input, Signature)"
    # The common case, a query without any signature, costs one case-insensitive search.
    if "signature" not in raw_query.lower():
        return None
    return _presigned(raw_query)


def _signed_scheme(authorization: str) -> str | None:
    credential = authorization.strip()
    lowered = credential.lower()
    for prefix, vendor in _SIGNED_PREFIXES.items():
        if lowered.startswith(prefix):
            return vendor
    cosmos = _cosmos_type(credential)
    if cosmos is not None:
        return "Azure Cosmos DB master key signature (type=master)" if cosmos == "master" else None
    # RFC 9110 §11.4 puts one space after the scheme; clients send tabs and more as well.
    scheme = (lowered.split(None, 1) or [""])[0]
    named = _SIGNED_SCHEMES.get(scheme)
    if named is not None:
        return f"{named} (Authorization: {scheme.upper()})"
    if scheme in _STABLE_SCHEMES:
        return None
    if "hmac" in scheme and "=" not in scheme:
        # A scheme named after its MAC (`SDK-HMAC-SHA256`, `ACS3-HMAC-SHA256`): a vendor's
        # request signature; the name is one scheme token, but it comes from the request.
        return "an Authorization scheme named after an HMAC"
    return _generic(credential)


def _cosmos_type(credential: str) -> str | None:
    """The `type` of an Azure Cosmos DB token (one token: no scheme, no whitespace, its
    three parameters in any order); None for any other credential."""
    if "type" not in credential.lower() or any(c.isspace() for c in credential):
        return None
    params = {name.lower(): value for name, value in parse_qsl(unquote(credential))}
    if not _COSMOS_PARAMS.issubset(params):
        return None
    return params["type"].strip().lower()


def _generic(credential: str) -> str | None:
    if _SIGNED_PARAM.search(credential) is None:
        return None
    return "an Authorization scheme that signs with a MAC or a nonce"


def _presigned(raw_query: str) -> str | None:
    names = {name.lower() for name, _ in parse_qsl(raw_query, keep_blank_values=True)}
    if "signature" in names and not names & {"expires", "awsaccesskeyid"}:
        names.discard("signature")  # a `signature` that is not a presigned URL's
    for name, what in _PRESIGNED.items():
        if name in names:
            return what
    return None


log = logging.getLogger("idemproxy.owner")

# SPEC §5: the default scope is a hash of the whole header, so a new token is a new scope.
AUTHORIZATION_OWNER_HINT = (
    "owner.strategy is authorization: jobs are scoped by a hash of the whole Authorization"
    " header, so a client whose token is refreshed between a request and its retry lands in a"
    " new scope and the retry executes again; with rotating tokens (OAuth, OIDC) use"
    " owner.strategy jwt or header:<NAME> set by a gateway. A credential signed afresh for"
    " every request (AWS SigV4, HTTP Message Signatures, Digest, Hawk, OAuth 1.0a, a presigned"
    " URL) would make every try a new scope: such governed requests are refused (400"
    " owner-unstable); for those clients use header:<NAME> set by a gateway that verified the"
    " signature, or none for a single tenant"
)
_UNSTABLE = (
    "The request's credential, {what}, is a signature made for this request alone: a retry"
    " signed again would be another owner and could execute again. Nothing was claimed or"
    " forwarded. The proxy needs an owner that stays the same on every try: owner.strategy"
    " header:<NAME> (set by a gateway that verified the signature), jwt, or none."
)


def log_owner_hint(settings: OwnerSettings) -> None:
    """Once at start-up (SPEC §5): what the default owner strategy means for rotating tokens
    and for credentials signed per request."""
    if settings.strategy == "authorization":
        log.info("%s", AUTHORIZATION_OWNER_HINT)


class OwnerVerifier(Protocol):
    def owner(self, authorization: str) -> str:
        """The owner of a present credential; raises `OwnerMissing` when it does not verify
        (and `KeyNotLoaded` when its key may be fetched yet)."""
        ...

    async def start(self, observe: FetchObserver = unobserved) -> None: ...

    async def close(self) -> None: ...

    def not_ready(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class OwnerPolicy:
    """`strategy` is "authorization", "header:<name>", "jwt" (with its `verifier`) or "none".

    `pepper`: owners are the HMAC-SHA256 of the credential's hash under it (SPEC §5).
    `legacy_owners`: the transition window to the pepper, when a job may still be under the
    owner the credential had without it (`derive_owners`)."""

    strategy: str = "authorization"
    required: bool = False
    verifier: OwnerVerifier | None = None
    pepper: bytes | None = None
    legacy_owners: bool = False
    # HMAC keyed once with the pepper, copied per request: a third of `hmac.new`'s cost.
    _keyed: hmac.HMAC | None = field(default=None, init=False, repr=False, compare=False)
    # The owner is a hash of the Authorization as sent (`authorization`, or `header:` naming
    # it): a signature made for one request would be an owner for one try (SPEC §5).
    _hashes_authorization: bool = field(default=False, init=False, repr=False, compare=False)
    # The header the owner comes from (None: every request is the global owner), from
    # `strategy`: read two or three times per governed request, so worked out once.
    header: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # An unverified "jwt" policy would hash whatever token is sent: never build one.
        if (self.strategy == "jwt") != (self.verifier is not None):
            raise ConfigError("owner.strategy jwt goes with a verifier, and only it")
        if self.legacy_owners and self.pepper is None:
            raise ConfigError("owner.legacy_owners is the transition to owner.pepper: set both")
        object.__setattr__(self, "header", _header_of(self.strategy))
        if self.pepper is not None:
            object.__setattr__(self, "_keyed", hmac.new(self.pepper, digestmod=hashlib.sha256))
        hashed = self.verifier is None and (self.header or "").lower() == "authorization"
        object.__setattr__(self, "_hashes_authorization", hashed)

    def validate(self) -> None:
        check_strategy(self.strategy)

    async def start(self, observe: FetchObserver = unobserved) -> None:
        """In the event loop, before the first request: an identity provider's keys are
        fetched (SPEC §5); `observe` hears how each fetch ended."""
        if self.verifier is not None:
            await self.verifier.start(observe)

    async def close(self) -> None:
        if self.verifier is not None:
            await self.verifier.close()

    def not_ready(self) -> str | None:
        """Why requests with a credential cannot be scoped yet (for /readyz); None when they
        can."""
        return None if self.verifier is None else self.verifier.not_ready()


def owner_policy(settings: OwnerSettings, keys: KeySource | None = None) -> OwnerPolicy:
    """The policy `settings` describe, built once at start-up: with `jwt`, this loads the keys,
    or takes `keys` (an identity provider's, proxy/idp/); `ConfigError` naming the field at
    fault."""
    verifier = None
    if settings.strategy == "jwt":
        verifier = JwtVerifier.from_settings(settings.jwt, keys=keys)
    pepper = None
    if settings.pepper is not None:
        pepper = settings.pepper.get_secret_value().encode("utf-8", "surrogateescape")
    return OwnerPolicy(
        settings.strategy, settings.required, verifier, pepper, settings.legacy_owners
    )


def derive_owner(policy: OwnerPolicy, headers: Mapping[str, str], raw_query: str = "") -> str:
    """The owner scope for a request; raises `OwnerMissing` when one is required and absent.

    With a verifier (`jwt`), a credential that is present but does not verify is 401 even when
    the owner is optional: it must never fall into the shared anonymous scope. The credential
    header sent more than once is `HeaderInvalid`, as the key is (SPEC §5). When the owner is
    a hash of the Authorization header, a credential signed for this request alone
    (`raw_query` holds a presigned URL's) is `OwnerUnstable`: each try would be an owner.
    """
    return derive_owners(policy, headers, raw_query)[0]


def _header_of(strategy: str) -> str | None:
    if strategy in ("authorization", "jwt"):
        return "Authorization"
    if strategy.startswith("header:"):
        return strategy.removeprefix("header:")
    return None


def derive_owners(
    policy: OwnerPolicy, headers: Mapping[str, str], raw_query: str = ""
) -> tuple[str, str | None]:
    """`derive_owner`'s owner, and with `legacy_owners` the owner the same credential had
    before the pepper (plain SHA-256), under which a job may still be (SPEC §5); else None.
    The shared scopes (anonymous, global) are the same with and without a pepper."""
    header = policy.header
    if header is None:
        return GLOBAL_OWNER, None
    if isinstance(headers, MultiMapping):  # `single_value`, in place: every governed request
        values = headers.getall(header, [])
        if len(values) > 1:
            raise HeaderInvalid(f"Send the {header} header exactly once.")
        credential = values[0] if values else None
    else:
        credential = headers.get(header)
    if policy._hashes_authorization:
        # SPEC §5: the hash of a signature made for one try is a scope for that try alone.
        what = per_request_signature(credential, headers, raw_query)
        if what is not None:
            raise OwnerUnstable(_UNSTABLE.format(what=what))
    if not credential:
        if policy.required:
            raise OwnerMissing()
        # SPEC §5: the anonymous scope is every such caller's: one whose credential is where
        # the strategy does not look would be handed the others' replays.
        elsewhere = credential_elsewhere(headers, raw_query, header)
        if elsewhere is not None:
            raise OwnerMissing(_ELSEWHERE.format(where=elsewhere, header=header))
        return ANONYMOUS_OWNER, None
    if policy.verifier is not None:
        plain = policy.verifier.owner(credential)
    else:
        plain = hash_credential(credential)
    keyed = policy._keyed
    if keyed is None:
        return plain, None
    # RFC 2104: HMAC-SHA256 of the plain owner under the pepper, hex like it.
    mac = keyed.copy()
    mac.update(plain.encode("ascii"))
    return mac.hexdigest(), plain if policy.legacy_owners else None


# Where APIs take a caller's credential (RFC 6265 cookies, RFC 6750 §2.3's query token, the
# API-key headers of the common gateways and SDKs), lower-cased.
_CREDENTIAL_HEADERS = (
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-api-key",
    "x-api-token",
    "x-token",
    "api-key",
    "apikey",
    "x-goog-api-key",
    "x-auth-token",
    "x-access-token",
    "private-token",
    "ocp-apim-subscription-key",
    "x-functions-key",
)
_CREDENTIAL_QUERY = frozenset(
    {"access_token", "api_key", "apikey", "api-key", "auth_token", "key", "token"}
)
_ELSEWHERE = (
    "This request carries a credential in {where}, which the owner strategy does not read"
    " (it reads {header}): its job would be in the anonymous scope every such caller shares,"
    " and replayed to any of them. Set owner.strategy to header:<NAME> (the header your"
    " credential or your gateway's verified identity is in), jwt, or none for a single tenant."
)


def credential_elsewhere(
    headers: Mapping[str, str], raw_query: str, strategy_header: str
) -> str | None:
    """Where a request without the strategy's credential carries one anyway (a header's name,
    or `the query`), or None."""
    if not isinstance(headers, CIMultiDictProxy | CIMultiDict):  # a plain mapping (tests, CLI)
        headers = CIMultiDict(headers)
    skip = strategy_header.lower()
    for name in _CREDENTIAL_HEADERS:
        if name == skip:
            continue
        # Every value: an empty first one beside a credential hid it from `get`. Loops, not
        # a generator: that would be a call per header name, on every anonymous request.
        for value in headers.getall(name, ()):
            if value.strip():
                return name.title() if name != "apikey" else name
    if raw_query and _names_a_credential(raw_query):
        return "the query"
    return None


def _names_a_credential(raw_query: str) -> bool:
    """Whether a parameter of the query is named as a credential, its name decoded as the
    backend decodes it (`access%5Ftoken` is `access_token`)."""
    for pair in raw_query.replace(";", "&").split("&"):
        name, _, value = pair.partition("=")
        if "%" in name or "+" in name:
            name = unquote_plus(name)
        if value and name.strip().lower() in _CREDENTIAL_QUERY:
            return True
    return False


def single_value(headers: Mapping[str, str], name: str) -> str | None:
    """The one value of `name`, None when absent; `HeaderInvalid` when it is repeated.

    A gateway that appends (`X-User: victim`, then `X-User: attacker`) leaves two values: taking
    the first would scope the request as someone the sender may not be, so none is believed.
    """
    if isinstance(headers, MultiMapping):
        values = headers.getall(name, [])
        if len(values) > 1:
            raise HeaderInvalid(f"Send the {name} header exactly once.")
        return values[0] if values else None
    return headers.get(name)


def hash_credential(credential: str) -> str:
    """The plain SHA-256 owner of a credential: the owner without a pepper."""
    return hashlib.sha256(credential.encode("utf-8", "surrogateescape")).hexdigest()


def owner_of_credential(policy: OwnerPolicy, credential: str) -> str:
    """The owner a request sending `credential` in the policy's header is scoped by (for an
    operator naming an owner by its credential)."""
    header = policy.header or "Authorization"
    return derive_owner(policy, {header: credential})
