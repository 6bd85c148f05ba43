"""The key ring of encryption at rest (SPEC §11): parsed once at start-up, errors name the
entry at fault and never its key; the codec binds a box to its job."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from pydantic import ValidationError

from idemproxy.config.settings import load_settings
from idemproxy.core.types import Job, JobState, SealedResponse, StoredResponse
from idemproxy.errors import ConfigError, ResponseUnreadable
from idemproxy.store.factory import serving_store
from idemproxy.store.layers import StoreStack
from idemproxy.store.redis.cache import RedisCachedStore
from idemproxy.store.seal.keyring import parse_key_ring
from idemproxy.store.seal.store import SealingStore
from tests.support.keyring import NEW, OLD, codec, key_entry

JOB = Job("0190-job", "owner", "key", "fp", JobState.COMPLETED, 2, 1)
RESPONSE = StoredResponse(200, (("X-A", "b"), ("X-Obs", "caf\udce9")), b"\x00body")


def test_the_first_key_is_the_primary_and_every_key_opens() -> None:
    ring = parse_key_ring(f"{NEW},\n {OLD}\n")
    assert (ring.primary, ring.ids) == ("k2", ("k2", "k1"))


def test_url_safe_and_unpadded_base64_are_read() -> None:
    raw = bytes(range(32))
    encoded = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    assert parse_key_ring(f"u:{encoded}").primary == "u"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no key given"),
        ("k1", "entry 1 is not id:base64"),
        ("bad id:" + "A" * 44, "entry 1 is not id:base64"),
        ("k1:!!!", "'k1' is not base64"),
        ("k1:" + base64.b64encode(b"short").decode(), "has 5 bytes; AES-256 needs 32"),
        (f"{OLD},{key_entry('k1', 3)}", "'k1' is given twice"),
    ],
)
def test_a_bad_ring_is_refused_without_echoing_a_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        parse_key_ring(text)
    assert OLD.partition(":")[2] not in str(caught.value)


def test_a_sealed_response_opens_only_for_its_own_job() -> None:
    ring = codec(OLD)
    sealed = ring.seal(JOB, RESPONSE)
    assert isinstance(sealed, SealedResponse) and b"body" not in sealed.sealed
    assert ring.open(JOB, sealed) == RESPONSE
    assert ring.seal(JOB, sealed) is sealed  # sealed once, whatever layer sees it again
    for other in (JOB._replace(id="0190-other"), JOB._replace(owner="o2"), JOB._replace(key="k")):
        with pytest.raises(ResponseUnreadable):
            ring.open(other, sealed)


def test_two_seals_of_one_response_differ() -> None:
    ring = codec(OLD)
    first, second = ring.seal(JOB, RESPONSE), ring.seal(JOB, RESPONSE)
    assert isinstance(first, SealedResponse) and isinstance(second, SealedResponse)
    assert first.sealed != second.sealed  # a fresh nonce each time


def test_the_keys_come_from_a_file_and_seal_outside_every_cache(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{NEW}\n{OLD}\n")
    settings = load_settings(
        upstream="http://x:1",
        store="postgresql://127.0.0.1/none",
        encryption={"keys_file": str(keys)},
        redis={"url": "redis://127.0.0.1:1"},
    )
    store = serving_store(settings)
    assert isinstance(store, SealingStore) and store.codec.primary == "k2"
    assert StoreStack.of(store).layer(RedisCachedStore) is not None
    assert store.record.seal is store.codec  # what the operators write is sealed with it too


def test_without_keys_nothing_seals() -> None:
    store = serving_store(load_settings(upstream="http://x:1", store="sqlite://:memory:"))
    assert not isinstance(store, SealingStore)


def test_a_bad_ring_stops_start_up() -> None:
    settings = load_settings(upstream="http://x:1", encryption={"keys": "k1:nope"})
    with pytest.raises(ConfigError, match=r"encryption\.keys"):
        serving_store(settings)


def test_require_sealed_reaches_the_codec_and_needs_a_ring() -> None:
    settings = load_settings(
        upstream="http://x:1",
        store="sqlite://:memory:",
        encryption={"keys": OLD, "require_sealed": True},
    )
    store = serving_store(settings)
    assert isinstance(store, SealingStore)
    clear = StoredResponse(200, (), b"planted")
    with pytest.raises(ResponseUnreadable, match="require_sealed"):
        store.opened(JOB, clear)
    with pytest.raises(ValidationError, match=r"require_sealed needs encryption\.keys"):
        load_settings(upstream="http://x:1", encryption={"require_sealed": True})
