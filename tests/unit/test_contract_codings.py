"""SPEC §3.4: a coded 2xx is checked against the contract decoded, and a contract route asks
its upstreams only for the codings the proxy can decode."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import pytest
from multidict import CIMultiDict

from idemproxy.proxy.upstream.contract import Contract, ask_checkable
from tests.support.named_upstream import WRONG_SHAPE

from .test_contract import contract

VALID = json.dumps({"id": "a", "choices": [{"text": "b"}]}).encode()


@pytest.mark.parametrize(
    "codings",
    [["gzip"], ["deflate"], ["gzip", "deflate"]],
    ids=["gzip", "deflate", "both"],
)
def test_a_coded_body_is_checked_decoded(tmp_path: Path, codings: list[str]) -> None:
    body = VALID
    for coding in codings:  # applied in order, as Content-Encoding lists them
        body = gzip.compress(body, mtime=0) if coding == "gzip" else zlib.compress(body)
    checked = contract(tmp_path)
    assert checked.violations(200, body) == ["body is not JSON"]
    assert checked.coded_violations(200, body, codings, 1024) == []


def test_a_decoded_body_that_breaks_the_schema_says_how(tmp_path: Path) -> None:
    body = gzip.compress(json.dumps(WRONG_SHAPE).encode())
    broken = contract(tmp_path).coded_violations(201, body, ["gzip"], 1024)
    assert broken and all(": " in line for line in broken)
    assert any("choices" in line for line in broken)


@pytest.mark.parametrize(
    ("body", "codings", "named"),
    [
        (b"\x1b\x00 opaque", ["br"], "br"),
        (b"\x28\xb5\x2f\xfd opaque", ["zstd"], "zstd"),
        (b"not gzip at all", ["gzip"], "gzip"),
        (gzip.compress(b"[" + b"0," * 2000 + b"0]"), ["gzip"], "gzip"),  # over the limit
        (b"x", ["x-\x00odd"], "x-\\x00odd"),  # the upstream's words, escaped: a NUL
        (b"x", ["caf\udce9"], "caf\\udce9"),  # and obs-text read as a lone surrogate
    ],
    ids=["br", "zstd", "corrupt", "over-limit", "nul", "surrogate"],
)
def test_a_body_that_cannot_be_decoded_is_a_breach_naming_its_coding(
    tmp_path: Path, body: bytes, codings: list[str], named: str
) -> None:
    broken = contract(tmp_path).coded_violations(200, body, codings, 1024)
    assert broken == [
        f"body coded with {named} cannot be checked against the contract: only gzip and"
        " deflate are decoded, up to max_stored_body bytes"
    ]


def test_only_a_2xx_is_decoded_and_checked(tmp_path: Path) -> None:
    checked: Contract = contract(tmp_path)
    assert checked.coded_violations(502, b"opaque", ["br"], 1024) == []
    assert checked.coded_violations(200, None, ["gzip"], 1024) == [
        "body too large to check against the contract"
    ]


@pytest.mark.parametrize(
    ("fields", "sent"),
    [
        (["gzip, deflate, br, zstd"], "gzip, deflate"),
        (["br;q=1", "x-gzip;q=0.5, *;q=0.1", "Identity"], "x-gzip;q=0.5, Identity"),
        (["GZIP;q=0, br"], "GZIP;q=0"),
        (["br", "zstd, , *"], "identity"),
        ([""], "identity"),
    ],
    ids=["common", "several-fields", "refused-kept", "none-left", "empty"],
)
def test_accept_encoding_keeps_only_codings_the_proxy_can_decode(
    fields: list[str], sent: str
) -> None:
    headers = CIMultiDict([("Accept-Encoding", value) for value in fields])
    ask_checkable(headers)
    assert headers.getall("Accept-Encoding") == [sent]


def test_a_request_without_accept_encoding_goes_without_it() -> None:
    headers: CIMultiDict[str] = CIMultiDict(Accept="application/json")
    ask_checkable(headers)
    assert "Accept-Encoding" not in headers
