"""A request id made up by the proxy is a random UUID (version 4) in its canonical text."""

from __future__ import annotations

import uuid

from idemproxy.http.headers import correlation_of, new_request_id


def test_a_made_up_request_id_is_a_version_4_uuid_of_the_rfc_variant() -> None:
    for _ in range(1_000):
        text = new_request_id()
        parsed = uuid.UUID(text)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert str(parsed) == text  # 8-4-4-4-12 lower-case hex


def test_made_up_request_ids_are_unique_and_random() -> None:
    ids = [uuid.UUID(new_request_id()) for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    # Every bit but the six of the version and variant varies.
    varying = 0
    for value in ids:
        varying |= value.int ^ ids[0].int
    assert bin(varying).count("1") == 128 - 6


def test_a_request_without_an_id_gets_one_made_up_that_goes_upstream() -> None:
    correlation = correlation_of("X-Request-Id", [])
    assert correlation.made
    assert uuid.UUID(correlation.request_id).version == 4
