"""SPEC §4.1: keys from another header or from a JSON Pointer into the body."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from pydantic import ValidationError

from idemproxy.config.keys import KeySourceSettings
from idemproxy.errors import KeyAmbiguous, KeyInvalid
from idemproxy.identity.key_source import KeySource, pointer_tokens

NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


def pointed(pointer: str, body: bytes, prefix: str = "") -> str | None:
    return KeySource.of(None, pointer, prefix).key(NO_HEADERS, body)


@pytest.mark.parametrize(
    ("pointer", "body", "key"),
    [
        ("/id", b'{"id": "evt_1"}', "evt_1"),
        ("/data/object/id", b'{"data": {"object": {"id": "pi_9"}}}', "pi_9"),
        ("/items/1", b'{"items": ["a", "b"]}', "b"),
        ("/a~1b/m~0n", b'{"a/b": {"m~n": "x"}}', "x"),
        ("/order", b'{"order": 820982911946154508}', "820982911946154508"),
        ("/id", b'{"other": 1}', None),
        ("/id", b'{"id": null}', None),
        ("/id", b"not json", None),
        ("/id", b"", None),
        ("/items/01", b'{"items": ["a", "b"]}', None),
        ("/items/5", b'{"items": ["a"]}', None),
        ("/id/x", b'{"id": "s"}', None),
        ("/id", b"[" * 100_000, None),
        ("/n", b'{"n": %s}' % (b"7" * 200), "7" * 200),
        ("/id", b'{"big": %s, "id": "k"}' % (b"9" * 5000), "k"),
        ("/n", b'{"n": -0}', "-0"),
        ("/id", b'{"id": "k", "x": NaN}', None),
        ("/id", b'{"id": "k", "x": [Infinity]}', None),
        ("/id", '{"id": "k"}'.encode("utf-16"), None),
        ("/id", '{"id": "k"}'.encode("utf-32-le"), None),
        ("/id", b'\xef\xbb\xbf{"id": "k"}', None),
        ("/id", b'{"id": "k", "s": "\xff"}', None),
        ("/items/\u00b2", b'{"items": ["a", "b", "c"]}', None),
        ("/items/\u0967", b'{"items": ["a", "b"]}', None),
        ("/items/\u00b2", '{"items": {"\u00b2": "sq"}}'.encode(), "sq"),
    ],
)
def test_pointer_finds_the_value_or_nothing(pointer: str, body: bytes, key: str | None) -> None:
    assert pointed(pointer, body) == key


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": true}',
        b'{"id": 1.5}',
        b'{"id": {"a": 1}}',
        b'{"id": ""}',
        b'{"id": "caf\\u00e9"}',
        b'{"id": "a b"}',
        b'{"id": "x", "id": "y"}',
        b'{"id": %s}' % (b"1" * 256),
        b'{"id": 1e3}',
    ],
)
def test_pointer_refuses_what_is_no_key(body: bytes) -> None:
    with pytest.raises(KeyInvalid):
        pointed("/id", body)


def test_a_repeated_name_hides_the_key_only_on_its_path() -> None:
    """RFC 8259 §4 leaves a repeated name's value to the parser: through it no key can be told
    (refused whatever `require_key` says, SPEC §4.1); elsewhere it hides nothing."""
    assert pointed("/id", b'{"id": "x", "n": {"m": 1, "m": 2}}') == "x"
    assert pointed("/a/id", b'{"a": {"id": "x", "z": 1, "z": 2}}') == "x"
    for pointer, body in [
        ("/id", b'{"id": "x", "id": "y"}'),
        ("/id", b'{"id": "x", "id": "x"}'),
        ("/a/id", b'{"a": {"id": "x"}, "a": {"id": "y"}}'),
    ]:
        with pytest.raises(KeyAmbiguous):
            pointed(pointer, body)


def test_prefix_comes_first_and_counts_towards_the_length() -> None:
    assert pointed("/id", b'{"id": "evt_1"}', prefix="stripe:") == "stripe:evt_1"
    with pytest.raises(KeyInvalid):
        pointed("/id", b'{"id": "%s"}' % (b"x" * 250), prefix="stripe:")


def test_header_source_parses_as_the_key_header_does() -> None:
    source = KeySource.of("X-GitHub-Delivery", None, "gh:")
    one = CIMultiDictProxy(CIMultiDict({"x-github-delivery": '"abc"'}))
    assert source.key(one, b"") == "gh:abc"
    assert source.key(NO_HEADERS, b"") is None
    two = CIMultiDictProxy(CIMultiDict([("X-GitHub-Delivery", "a"), ("X-GitHub-Delivery", "b")]))
    with pytest.raises(KeyInvalid):
        source.key(two, b"")


def test_pointer_tokens_unescape_in_rfc_6901_order() -> None:
    assert pointer_tokens("/~01") == ("~1",)
    assert pointer_tokens("/") == ("",)


@pytest.mark.parametrize(
    "fields",
    [
        {"pointer": "id"},
        {"pointer": "/a~2"},
        {"header": "Bad Name"},
        {"prefix": "a b"},
        {"header": "X-Id", "pointer": "/id"},
    ],
)
def test_settings_refuse(fields: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        KeySourceSettings.model_validate(fields)
