"""Cache entries (pure): everything a replay needs survives the round trip, bytes exactly."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from idemproxy.constants import REDIS_GONE_PREFIX, REDIS_JOB_PREFIX
from idemproxy.core.decision import Policy, Reject, Replay, decide
from idemproxy.core.types import Job, JobState, SealedResponse, StoredResponse
from idemproxy.store.redis.codec import decode, encode, entry_name, tombstone_name
from idemproxy.store.seal.codec import EntryTags
from idemproxy.store.seal.keyring import parse_key_ring
from tests.support.keyring import NEW, OLD, codec

OWNER = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
BODY = b"\x00\xff\n\r\n not utf-8 \x80\xc3\x28\n"
HEADERS = (
    ("Content-Type", "application/octet-stream"),
    ("X-Dup", "a"),
    ("x-dup", "b"),
    # obs-text as proxy/upstream/client.py decodes it (SPEC §7): stored and replayed byte for byte.
    ("X-Name", b"caf\xe9 \xff".decode("utf-8", "surrogateescape")),
)


def _job(body: bytes | None = BODY) -> Job:
    return Job(
        id="0b6f4c3e-5a7c-4f43-9d1d-3c9b8f3e2a10",
        owner=OWNER,
        key='k"1 é',
        fingerprint="fp",
        state=JobState.COMPLETED,
        version=3,
        attempt_count=2,
        method="POST",
        path="/charges",
        completed_by=2,
        response=StoredResponse(201, HEADERS, body),
        expires_at=datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC),
    )


@pytest.mark.parametrize("body", [BODY, b"", None])
def test_a_completed_job_survives_the_round_trip(body: bytes | None) -> None:
    job = _job(body)
    assert decode(encode(job), job.owner, job.key) == job


def test_the_decoded_job_replays_or_mismatches_like_the_stored_one() -> None:
    job = decode(encode(_job()), OWNER, 'k"1 é')
    assert job is not None
    assert decide(job, "fp", Policy()) == Replay(StoredResponse(201, HEADERS, BODY))
    assert isinstance(decide(job, "other", Policy()), Reject)


@pytest.mark.parametrize(
    "payload", [b"", b"2{}\n", b"1not json\n", b'1{"id": "x"}\n', b"1{}", b"\xff\xfe"]
)
def test_an_entry_it_cannot_read_is_a_miss(payload: bytes) -> None:
    assert decode(payload, OWNER, "k") is None


def _altered(**fields: object) -> bytes:
    """A valid entry with some of its metadata replaced (as someone with write access to Redis
    could): `None` removes the field."""
    entry = encode(_job())
    head, _, body = entry[1:].partition(b"\n")
    meta = json.loads(head)
    for name, value in fields.items():
        if value is None:
            del meta[name]
        else:
            meta[name] = value
    return entry[:1] + json.dumps(meta).encode() + b"\n" + body


@pytest.mark.parametrize(
    "fields",
    [
        {"exp": 1e20},  # beyond what a timestamp holds: OverflowError
        {"exp": -1e20},
        {"exp": "2030"},
        {"s": 0},  # no status this proxy stores (RFC 9110 §15): never replayed as one
        {"s": 999},
        {"s": 101},
        {"s": True},
        {"s": 201.0},
        {"s": "201"},
        {"omit": "no"},  # bool("no") is True: the body would be replayed as omitted
        {"omit": 0},
        {"v": True},
        {"v": "3"},
        {"n": 2.5},
        {"by": "2"},
        {"id": 7},
        {"fp": None},
        {"h": [["a"]]},
        {"h": [["X-A", "a\r\nSet-Cookie: planted=1"]]},  # a head could not carry it: a 500
        {"h": [["X-A\n", "a"]]},
        {"h": [["X-A", "a\u0000"]]},
        {"h": [["X-A", 1]]},
        {"h": {"X-A": "a"}},
    ],
)
def test_an_entry_with_fields_encode_never_writes_is_a_miss(fields: dict[str, object]) -> None:
    """SPEC §11: an entry this version cannot read is a miss, never an error (a 500 without a
    problem) nor a replay of what no upstream answered."""
    assert decode(_altered(**fields), OWNER, 'k"1 é') is None


def test_an_entry_with_the_fields_encode_writes_is_read() -> None:
    assert decode(_altered(), OWNER, 'k"1 é') == _job()
    assert decode(_altered(by=None), OWNER, 'k"1 é') is None  # the field must be there
    assert decode(b"1[]\n", OWNER, "k") is None


@pytest.mark.parametrize(("owner", "key"), [(OWNER[::-1], 'k"1 é'), (OWNER, "k2")])
def test_an_entry_read_under_another_owners_or_keys_name_is_a_miss(owner: str, key: str) -> None:
    """SPEC §5: an entry copied under another name (by someone who can write to Redis) is
    never replayed as that owner's or key's."""
    assert decode(encode(_job()), owner, key) is None


def test_an_entry_that_does_not_say_whose_it_is_is_a_miss() -> None:
    assert decode(_altered(sc=None), OWNER, 'k"1 é') is None  # as a version before it wrote
    assert decode(_altered(sc=7), OWNER, 'k"1 é') is None


def test_names_hash_owner_and_key_and_keep_tombstones_in_the_entry_slot() -> None:
    name = entry_name(OWNER, "secret-key")
    assert name.startswith(REDIS_JOB_PREFIX)
    assert OWNER not in name and "secret-key" not in name
    assert entry_name(OWNER, "k") != entry_name(OWNER + "x", "k") != entry_name(OWNER, "k2")
    assert entry_name("a\x00b", "c") != entry_name("a", "b\x00c")
    tombstone = tombstone_name(name, "job-1")
    assert tombstone.startswith(REDIS_GONE_PREFIX) and tombstone.endswith(":job-1")
    slot = name[name.index("{") : name.index("}") + 1]
    assert slot in tombstone  # one hash slot: the write script may read both


# --- encryption at rest (SPEC §11) ------------------------------------------------------------


def test_a_sealed_entry_holds_the_box_only_and_reads_back_sealed() -> None:
    ring = codec(OLD)
    job = _job()
    sealed = job._replace(response=ring.seal(job, job.response))  # type: ignore[arg-type]
    payload = encode(sealed)
    assert payload.startswith(b"2") and BODY not in payload and b"octet-stream" not in payload
    read = decode(payload, job.owner, job.key)
    assert read is not None and isinstance(read.response, SealedResponse)
    assert ring.open(read, read.response) == job.response


def test_a_sealed_entry_is_never_read_as_a_clear_one() -> None:
    job = _job()
    sealed = job._replace(response=codec(OLD).seal(job, job.response))  # type: ignore[arg-type]
    as_format_1 = b"1" + encode(sealed)[1:]  # an older proxy's format byte on a sealed entry
    assert decode(as_format_1, job.owner, job.key) is None  # no "h": a miss, not garbage


# --- tags under the key ring (SPEC §11): an entry's fields in the clear cannot be changed ------


def _tags(*entries: str) -> EntryTags:
    return EntryTags(parse_key_ring(",".join(entries)))


def _sealed() -> Job:
    job = _job()
    return job._replace(response=codec(OLD).seal(job, job.response))  # type: ignore[arg-type]


@pytest.mark.parametrize("job", [_job(), _sealed()], ids=["clear", "sealed"])
def test_a_tagged_entry_reads_back_under_its_key_and_any_ring_holding_it(job: Job) -> None:
    payload = encode(job, _tags(OLD))
    assert payload.startswith(b"3k1:")
    assert decode(payload, job.owner, job.key, _tags(OLD)) == job
    assert decode(payload, job.owner, job.key, _tags(NEW, OLD)) == job  # after a rotation
    assert decode(payload, job.owner, job.key, _tags(NEW)) is None  # its key retired
    assert decode(payload, job.owner, job.key) is None  # no ring: it cannot be checked


@pytest.mark.parametrize("job", [_job(), _sealed()], ids=["clear", "sealed"])
@pytest.mark.parametrize(
    ("field", "value"), [("fp", "another payload's"), ("exp", 4102444800.0), ("v", 9)]
)
def test_a_tagged_entry_with_a_field_changed_is_a_miss(job: Job, field: str, value: object) -> None:
    """Whoever writes to Redis cannot make another payload replay the response (`fp`), keep
    the entry past its job's expiry (`exp`) or change what the store holds (`v`)."""
    tagged = encode(job, _tags(OLD))
    line, _, entry = tagged.partition(b"\n")
    head, _, body = entry[1:].partition(b"\n")
    meta = json.loads(head) | {field: value}
    changed = entry[:1] + json.dumps(meta, separators=(",", ":")).encode() + b"\n" + body
    assert decode(changed, job.owner, job.key) is not None  # untagged, it would be read
    assert decode(line + b"\n" + changed, job.owner, job.key, _tags(OLD)) is None


def test_a_tagged_clear_entry_with_its_body_changed_is_a_miss() -> None:
    tagged = bytearray(encode(_job(), _tags(OLD)))
    tagged[-2] ^= 0x01
    assert decode(bytes(tagged), OWNER, 'k"1 é', _tags(OLD)) is None


@pytest.mark.parametrize("job", [_job(), _sealed()], ids=["clear", "sealed"])
def test_with_a_ring_an_untagged_entry_is_a_miss(job: Job) -> None:
    """Planted, or written by an older proxy: read once from the store, then tagged."""
    assert decode(encode(job), job.owner, job.key, _tags(OLD)) is None


@pytest.mark.parametrize(
    "payload", [b"3", b"3k1:zz\n1{}\n", b"3k1\n1{}\n", b"3k1:00\n", b"3k1:" + b"00" * 28 + b"\n2"]
)
def test_a_tagged_entry_it_cannot_read_is_a_miss(payload: bytes) -> None:
    assert decode(payload, OWNER, 'k"1 é', _tags(OLD)) is None


def test_a_tag_spelled_otherwise_than_encode_writes_it_is_a_miss() -> None:
    line, _, entry = encode(_job(), _tags(OLD)).partition(b"\n")
    key_id, _, tag = line.partition(b":")
    assert decode(line + b"\n" + entry, OWNER, 'k"1 é', _tags(OLD)) is not None
    for spelled in (b" " + tag, tag.upper(), tag[:8] + b" " + tag[8:]):
        assert decode(key_id + b":" + spelled + b"\n" + entry, OWNER, 'k"1 é', _tags(OLD)) is None
