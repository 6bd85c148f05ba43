"""SPEC §4: parsing and validating the Idempotency-Key header."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idemproxy.constants import KEY_MAX_LENGTH
from idemproxy.errors import KeyInvalid
from idemproxy.identity.intent import parse_key

VISIBLE_ASCII = "".join(chr(code) for code in range(0x21, 0x7F))
BARE_SAFE = "".join(char for char in VISIBLE_ASCII if char not in '",\\')


def quote(key: str) -> str:
    """The RFC 8941 sf-string serialisation of `key`."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


@pytest.mark.parametrize(
    ("header", "key"),
    [
        pytest.param("abc", "abc", id="bare"),
        pytest.param('"abc"', "abc", id="quoted"),
        pytest.param("a", "a", id="bare-one-char"),
        pytest.param('"a"', "a", id="quoted-one-char"),
        pytest.param(
            "550e8400-e29b-41d4-a716-446655440000",
            "550e8400-e29b-41d4-a716-446655440000",
            id="bare-uuid",
        ),
        pytest.param(
            "!#$%&'()*+-./:;<=>?@[]^_`{|}~", "!#$%&'()*+-./:;<=>?@[]^_`{|}~", id="bare-punctuation"
        ),
        pytest.param('"a\\"b"', 'a"b', id="quoted-escaped-quote"),
        pytest.param('"a\\\\b"', "a\\b", id="quoted-escaped-backslash"),
        pytest.param('"\\\\\\""', '\\"', id="quoted-only-escapes"),
        pytest.param('"a,b"', "a,b", id="quoted-comma-inside-string"),
        pytest.param(" abc\t", "abc", id="bare-surrounding-ows"),
        pytest.param(' "abc" ', "abc", id="quoted-surrounding-ows"),
        pytest.param("k" * KEY_MAX_LENGTH, "k" * KEY_MAX_LENGTH, id="bare-255-chars"),
        pytest.param(quote("k" * KEY_MAX_LENGTH), "k" * KEY_MAX_LENGTH, id="quoted-255-chars"),
        pytest.param(
            quote('"' * KEY_MAX_LENGTH), '"' * KEY_MAX_LENGTH, id="quoted-255-escaped-chars"
        ),
    ],
)
def test_valid_keys(header: str, key: str) -> None:
    assert parse_key([header]) == key


@pytest.mark.parametrize(
    "header",
    [
        pytest.param("", id="empty"),
        pytest.param('""', id="quoted-empty"),
        pytest.param("   ", id="spaces-only"),
        pytest.param("\t \t", id="whitespace-only"),
        pytest.param("k" * (KEY_MAX_LENGTH + 1), id="bare-256-chars"),
        pytest.param(quote("k" * (KEY_MAX_LENGTH + 1)), id="quoted-256-chars"),
        pytest.param("clé", id="bare-non-ascii"),
        pytest.param('"clé"', id="quoted-non-ascii"),
        pytest.param("key\u200b", id="zero-width-space"),
        pytest.param("\udcff", id="surrogate-escaped-byte"),
        pytest.param("a\rb", id="cr-inside"),
        pytest.param("a\nb", id="lf-inside"),
        pytest.param("a\r\nX-Injected: 1", id="crlf-header-injection"),
        pytest.param("a\x00b", id="nul-inside"),
        pytest.param("a\tb", id="tab-inside"),
        pytest.param("a\x7fb", id="del-inside"),
        pytest.param("a\x1bb", id="escape-inside"),
        pytest.param('"a\x00b"', id="quoted-nul-inside"),
        pytest.param('"a\tb"', id="quoted-tab-inside"),
        pytest.param("a b", id="space-inside"),
        pytest.param('"a b"', id="quoted-space-inside"),
        pytest.param('"abc', id="unterminated-quote"),
        pytest.param('abc"', id="trailing-quote-only"),
        pytest.param('"', id="lone-quote"),
        pytest.param('a"b', id="bare-quote-inside"),
        pytest.param('"abc\\"', id="escaped-closing-quote"),
        pytest.param('"abc"x', id="text-after-closing-quote"),
        pytest.param('"abc";p=1', id="sf-parameters"),
        pytest.param('"abc""def"', id="two-adjacent-strings"),
        pytest.param('"a\\b"', id="bad-escape-letter"),
        pytest.param('"a\\n"', id="bad-escape-n"),
        pytest.param('"a\\ "', id="bad-escape-space"),
        pytest.param("a\\b", id="bare-backslash"),
        pytest.param("a,b", id="bare-comma-joined"),
        pytest.param("a, b", id="comma-joined-with-space"),
        pytest.param('"a", "b"', id="comma-joined-quoted"),
        pytest.param('"a",b', id="comma-joined-mixed"),
        pytest.param(",", id="comma-only"),
    ],
)
def test_invalid_keys(header: str) -> None:
    with pytest.raises(KeyInvalid):
        parse_key([header])


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(["a", "b"], id="two-different-values"),
        pytest.param(["a", "a"], id="two-equal-values"),
        pytest.param(['"a"', "a"], id="quoted-and-bare"),
        pytest.param(["a", ""], id="value-and-empty"),
        pytest.param(["a", "b", "c"], id="three-values"),
    ],
)
def test_more_than_one_header_is_invalid(values: list[str]) -> None:
    with pytest.raises(KeyInvalid):
        parse_key(values)


@pytest.mark.parametrize("values", [[], ()], ids=["empty-list", "empty-tuple"])
def test_no_header_is_none(values: list[str]) -> None:
    assert parse_key(values) is None


def test_key_invalid_is_a_400_problem() -> None:
    with pytest.raises(KeyInvalid) as caught:
        parse_key(["a b"])
    assert caught.value.status == 400
    assert caught.value.code == "key-invalid"


@pytest.mark.parametrize(
    "header",
    ["<script>alert(1)</script> x", "secret\r\nX-Evil: 1", '"bad\\q"', "'; DROP TABLE jobs; -- "],
    ids=["markup", "crlf", "bad-escape", "sql"],
)
def test_error_detail_never_echoes_the_key(header: str) -> None:
    """SPEC §8: never echo raw attacker bytes."""
    with pytest.raises(KeyInvalid) as caught:
        parse_key([header])
    detail = caught.value.detail
    assert header not in detail
    assert header.strip().strip('"') not in detail


@given(st.text(alphabet=BARE_SAFE, min_size=1, max_size=KEY_MAX_LENGTH))
def test_bare_keys_round_trip(key: str) -> None:
    assert parse_key([key]) == key


@given(st.text(alphabet=VISIBLE_ASCII, min_size=1, max_size=KEY_MAX_LENGTH))
def test_quoted_keys_round_trip(key: str) -> None:
    assert parse_key([quote(key)]) == key


@given(st.text(alphabet=BARE_SAFE, min_size=1, max_size=KEY_MAX_LENGTH))
def test_bare_and_quoted_forms_normalise_to_the_same_key(key: str) -> None:
    assert parse_key([key]) == parse_key([quote(key)])


@given(
    st.text(alphabet=BARE_SAFE, max_size=100),
    st.characters(exclude_characters=VISIBLE_ASCII + " \t"),
    st.text(alphabet=BARE_SAFE, max_size=100),
)
def test_any_character_outside_visible_ascii_is_invalid(
    prefix: str, char: str, suffix: str
) -> None:
    key = prefix + char + suffix
    with pytest.raises(KeyInvalid):
        parse_key([key])
    with pytest.raises(KeyInvalid):
        parse_key([quote(key)])


@given(st.text(alphabet=VISIBLE_ASCII, min_size=KEY_MAX_LENGTH + 1, max_size=KEY_MAX_LENGTH + 50))
def test_any_quoted_key_over_255_chars_is_invalid(key: str) -> None:
    with pytest.raises(KeyInvalid):
        parse_key([quote(key)])
