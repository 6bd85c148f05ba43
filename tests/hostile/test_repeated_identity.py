"""SPEC §5: the header a job is scoped by, sent more than once, is refused before any storage call.

A gateway that appends rather than replaces (`X-User: victim` from the client, then
`X-User: attacker` from the gateway, or the other way round) leaves two values. Reading the first
scoped the request as the victim and replayed the victim's stored response.
"""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from idemproxy.errors import HeaderInvalid
from idemproxy.identity.intent import OwnerPolicy, derive_owner
from tests.support.backend import Ledger
from tests.support.jwtkit import SECRET, claims, hs256, token

from .conftest import CountingStore, ListeningProxy
from .test_identity import exchange


def post(identity: bytes, key: bytes = b"k-shared") -> bytes:
    return (
        b"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: "
        + key
        + b"\r\n"
        + identity
        + b"Content-Length: 3\r\nConnection: close\r\n\r\npay"
    )


CASES = {
    "header:X-User": (b"X-User: victim\r\n", b"X-User: victim\r\nX-User: attacker\r\n"),
    "header:x-user (other case)": (b"X-User: victim\r\n", b"x-user: victim\r\nX-USER: victim\r\n"),
    "authorization": (
        b"Authorization: Bearer victim\r\n",
        b"Authorization: Bearer victim\r\nAuthorization: Bearer attacker\r\n",
    ),
}


@pytest.mark.parametrize("case", CASES)
async def test_a_repeated_owner_header_is_400_and_never_reaches_the_victims_job(
    listening_proxy: ListeningProxy, counting_store: CountingStore, ledger: Ledger, case: str
) -> None:
    strategy = case.split(" ", maxsplit=1)[0].replace("x-user", "X-User")
    address = await listening_proxy(inject_store=counting_store, owner={"strategy": strategy})
    victims, repeated = CASES[case]
    first = await exchange(address, post(victims))
    assert first.startswith(b"HTTP/1.1 201"), first[:200]
    assert ledger.count("k-shared") == 1
    counting_store.calls.clear()

    answer = await exchange(address, post(repeated))
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"Idempotency-Error: header-invalid\r\n" in rest
    assert b"Idempotent-Replayed" not in rest  # not the victim's stored response
    assert counting_store.calls == []  # refused before any storage call
    assert ledger.count("k-shared") == 1


def test_a_repeated_bearer_jwt_is_refused_even_when_both_verify() -> None:
    policy = OwnerPolicy("jwt", verifier=hs256())
    alice = token(claims("alice"), SECRET, "HS256")
    mallory = token(claims("mallory"), SECRET, "HS256")
    headers = CIMultiDict(
        [("Authorization", f"Bearer {alice}"), ("Authorization", f"Bearer {mallory}")]
    )
    with pytest.raises(HeaderInvalid) as caught:
        derive_owner(policy, headers)
    assert caught.value.status == 400
    assert caught.value.code == "header-invalid"
    assert alice not in caught.value.detail


SINGLETONS = {
    # Routing (Host), fingerprint (Content-Type) and framing: aiohttp's parser refuses these
    # repeated (RFC 9110 §5.3: not list-valued), so two values can never disagree here either.
    "host": b"Host: other\r\n",
    "content-type": b"Content-Type: application/json\r\nContent-Type: text/plain\r\n",
}


@pytest.mark.parametrize("case", SINGLETONS)
async def test_repeated_routing_and_fingerprint_headers_are_refused_too(
    listening_proxy: ListeningProxy, counting_store: CountingStore, ledger: Ledger, case: str
) -> None:
    address = await listening_proxy(inject_store=counting_store)
    answer = await exchange(address, post(b"Authorization: Bearer alice\r\n" + SINGLETONS[case]))
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"400", answer[:300]
    assert counting_store.calls == []
    assert ledger.count() == 0
