"""SPEC §4.1, §6: a valid JSON body names its key and has its canonical form at any depth
(identity/deep_json.py), and every body the C parser handled is read and written as before."""

from __future__ import annotations

import json
from collections.abc import Iterator
from json.encoder import encode_basestring
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from idemproxy.errors import BodyTooLarge, KeyAmbiguous, KeyInvalid
from idemproxy.identity import deep_json, key_source
from idemproxy.identity import intent as fingerprint_module
from idemproxy.identity.intent import canonical_json, fingerprint
from idemproxy.identity.key_source import KeySource

NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
DEPTH = 10_000


def pointed(pointer: str, body: bytes) -> str | None:
    return KeySource.of(None, pointer, "").key(NO_HEADERS, body)


# --- the key at any depth ------------------------------------------------------------------------


def test_a_deep_body_names_its_top_level_key() -> None:
    """The issue's case: a member 10,000 levels deep beside `/order_id` hid the key."""
    body = b'{"order_id": "o-1", "x": %s}' % (b"[" * DEPTH + b"]" * DEPTH)
    assert pointed("/order_id", body) == "o-1"
    body = b'{"x": %s, "id": "evt_1"}' % (b'{"a":' * DEPTH + b"1" + b"}" * DEPTH)
    assert pointed("/id", body) == "evt_1"


def test_a_key_10000_levels_deep_is_found() -> None:
    body = b"[" * DEPTH + b'{"id": 42}' + b"]" * DEPTH
    assert pointed("/0" * DEPTH + "/id", body) == "42"
    assert pointed("/0" * DEPTH + "/other", body) is None


def test_a_deep_body_keeps_every_rule_of_the_shallow_one() -> None:
    deep = b"[" * DEPTH + b"]" * DEPTH
    # A repeated name elsewhere hides nothing; on the key's path no key can be told.
    assert pointed("/id", b'{"id": "k", "x": %s, "d": {"m": 1, "m": 2}}' % deep) == "k"
    with pytest.raises(KeyAmbiguous):
        pointed("/d/m", b'{"id": "k", "x": %s, "d": {"m": "1", "m": "2"}}' % deep)
    assert pointed("/id", b'{"id": "k", "x": %s, "n": NaN}' % deep) is None
    assert pointed("/id", b'{"id": "k", "x": %s' % deep) is None  # truncated
    assert pointed("/id", b'{"id": "k", "x": %s}]' % deep) is None  # extra data
    assert pointed("/id", b"[" * 100_000) is None


# --- the fingerprint at any depth ----------------------------------------------------------------


def test_a_deep_body_is_canonicalised() -> None:
    spaced = b'{ "b" : 1 , "a" : %s }' % (b"[ " * DEPTH + b"2.50, -0, 1" + b" ]" * DEPTH)
    canonical = b'{"a":%s,"b":1}' % (b"[" * DEPTH + b"2.50,-0,1" + b"]" * DEPTH)
    assert canonical_json(spaced) == canonical
    assert canonical_json(canonical) == canonical
    head = ("POST", "/pay", "", "application/json", None, None)
    assert fingerprint(head, spaced) == fingerprint(head, canonical)
    assert fingerprint(head, spaced) != fingerprint(head, canonical.replace(b"2.50", b"2.5"))


def test_a_pointer_is_excluded_from_a_deep_body() -> None:
    deep = b'{"a":' * DEPTH + b'{"nonce": 1, "v": 2}' + b"}" * DEPTH
    excluded = ("/" + "/".join(["a"] * DEPTH) + "/nonce",)
    other = deep.replace(b'"nonce": 1', b'"nonce": 7')
    assert canonical_json(deep, excluded) == canonical_json(other, excluded)
    assert canonical_json(deep) != canonical_json(other)


# --- the same as the C path on every body it handles -------------------------------------------


def _old_canonical_parts(node: Any, encoder: json.JSONEncoder) -> Iterator[str]:
    """identity/intent.py's recursive writer before deep_json: the reference."""
    if isinstance(node, dict):
        yield "{"
        for index, name in enumerate(sorted(node)):
            yield ("," if index else "") + encode_basestring(name) + ":"
            yield from _old_canonical_parts(node[name], encoder)
        yield "}"
    elif isinstance(node, list):
        yield "["
        for index, item in enumerate(node):
            if index:
                yield ","
            yield from _old_canonical_parts(item, encoder)
        yield "]"
    elif isinstance(node, deep_json.Verbatim):
        yield node.text
    else:
        yield encoder.encode(node)


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_DECODERS = [
    key_source._DECODER,  # the key's: integers as text, repeated names noted
    fingerprint_module._DECODER,  # the canonical form's, and its decoder for -0
    fingerprint_module._WITH_NEGATIVE_ZERO,
    json.JSONDecoder(),
    json.JSONDecoder(
        parse_float=deep_json.Verbatim,
        parse_int=deep_json.Verbatim,
        parse_constant=deep_json.Verbatim,
        object_pairs_hook=list,
    ),
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
documents = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=30,
)
# Valid and broken texts alike: bodies of every kind reach the parser.
json_ish = st.text(alphabet='{}[],:" \t\n\\/u0123456789.eE+-truefalsnNaIfiy\x00\x1f\u00e9\ud800')


@st.composite
def texts(draw: st.DrawFn) -> str:
    document = draw(documents)
    indent = draw(st.sampled_from([None, 0, 1, "\t"]))
    text = json.dumps(document, indent=indent, ensure_ascii=draw(st.booleans()))
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(json_ish) + text[cut:]
    return text


def _outcome(parse: Any, text: str) -> tuple[str, Any]:
    try:
        value = parse(text)
    except KeyInvalid:
        return "key-invalid", None
    except ValueError:
        return "invalid", None
    return "value", _comparable(value)


def _comparable(value: Any) -> Any:
    """The value with its types and order, floats by their repr (NaN is never equal)."""
    if isinstance(value, deep_json.Verbatim):
        return (type(value).__name__, value.text)
    if isinstance(value, list | tuple):
        return (type(value).__name__, [_comparable(item) for item in value])
    if isinstance(value, dict):
        return ("dict", [(name, _comparable(item)) for name, item in value.items()])
    return (type(value).__name__, repr(value))


@given(texts(), st.sampled_from(_DECODERS))
def test_the_parser_reads_what_the_c_parser_reads(text: str, decoder: json.JSONDecoder) -> None:
    assert _outcome(lambda t: deep_json.loads(t, decoder), text) == _outcome(decoder.decode, text)


@given(documents)
def test_the_writer_writes_what_the_c_writer_writes(document: Any) -> None:
    assert deep_json.canonical(document, _ENCODER) == _ENCODER.encode(document)


@given(texts())
def test_canonical_json_is_what_it_was_for_every_body_the_c_path_handled(text: str) -> None:
    """Stored jobs must still match their retries: the old canonicaliser is the oracle."""
    body = text.encode("utf-8", "surrogatepass")
    assert canonical_json(body) == _old_canonical_json(body)


def _old_canonical_json(body: bytes) -> bytes:
    """canonical_json before deep_json, on top of the same decoders (test_fingerprint.py pins
    the decoders themselves against `json.loads`)."""
    from idemproxy.identity import intent as module

    try:
        # The text as json.loads finds it, and the decoder with the -0 hook (which the module
        # uses only for bodies that may hold that token) for every body: the same values.
        text = body.decode(json.detect_encoding(body))
        document = module._WITH_NEGATIVE_ZERO.decode(text)
        try:
            canonical = _ENCODER.encode(document)
        except TypeError:
            canonical = "".join(_old_canonical_parts(document, _ENCODER))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return body
    return canonical.encode("utf-8", "surrogatepass")


def test_a_number_token_kept_as_text_is_written_as_before() -> None:
    body = b'{"b": [1.10, -0, 1E2, 0.30000000000000000001], "a": "\\u00e9"}'
    assert canonical_json(body) == _old_canonical_json(body)
    assert canonical_json(body) == '{"a":"é","b":[1.10,-0,1E2,0.30000000000000000001]}'.encode()


@given(documents, st.integers(1, 3))
def test_the_sliced_writer_writes_what_the_c_writer_writes(document: Any, width: int) -> None:
    """A large body is written a slice at a time (so that the event loop can run between
    slices): the same text, whatever the slices."""
    wide = deep_json._SLICE
    deep_json._SLICE = width
    try:
        assert deep_json.canonical(document, _ENCODER, sliced=True) == _ENCODER.encode(document)
    finally:
        deep_json._SLICE = wide


def test_a_large_body_is_written_as_a_small_one_is() -> None:
    """Above 64 KiB canonical_json writes in slices: a slice with a kept number token or a
    deep member is walked, the others written by the C encoder."""
    members = [b'{"k%d": [%d, 2.5, "\\u00e9"]}' % (n, n) for n in range(5_000)]
    members[10] = b"[1.50, -0]"
    members[20] = b"[" * DEPTH + b"]" * DEPTH
    body = b"[" + b", ".join(members) + b"]"
    assert len(body) > 64 * 1024
    expected = b"[" + b",".join(m.replace(b" ", b"") for m in members) + b"]"
    assert canonical_json(body) == expected.replace(b"\\u00e9", "é".encode())


def test_a_deep_body_over_1_mib_is_refused_never_taken_as_keyless() -> None:
    """The stack parser costs 10 to 20 times the C one: beyond `MAX_DEEP_TEXT` a body too deep
    for the C parser is `413 body-too-large` (SPEC §9) for its key and its fingerprint alike."""
    levels = deep_json.MAX_DEEP_TEXT // 2
    large = b'{"id": "k", "x": %s}' % (b"[" * levels + b"]" * levels)
    with pytest.raises(BodyTooLarge, match="deeper than about 1,000 levels"):
        pointed("/id", large)
    with pytest.raises(BodyTooLarge):
        canonical_json(large)
    shallow = b'{"id": "k", "x": [%s]}' % (b"[1]," * levels + b"[1]")
    assert pointed("/id", shallow) == "k"  # a large body the C parser reads is read
    levels = deep_json.MAX_DEEP_TEXT // 2 - 20
    within = b'{"id": "k", "x": %s}' % (b"[" * levels + b"]" * levels)
    assert len(within) <= deep_json.MAX_DEEP_TEXT
    assert pointed("/id", within) == "k"
