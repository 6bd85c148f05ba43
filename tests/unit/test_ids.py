"""Job ids are UUIDv7 (RFC 9562 §5.7): time-ordered, random below the time, unique."""

from __future__ import annotations

import os
import time
import uuid

from idemproxy.identity.intent import new_job_id


def test_a_job_id_is_a_version_7_uuid_of_the_rfc_variant() -> None:
    parsed = uuid.UUID(new_job_id())
    assert parsed.version == 7
    assert parsed.variant == uuid.RFC_4122


def test_ids_carry_the_time_and_sort_by_it() -> None:
    before = time.time_ns() // 1_000_000
    first = new_job_id()
    time.sleep(0.002)
    second = new_job_id()
    after = time.time_ns() // 1_000_000
    assert before <= uuid.UUID(first).int >> 80 <= after
    assert first < second  # later ids sort after earlier ones, as text and in an index


def test_ids_are_unique_and_random_below_the_time() -> None:
    ids = [uuid.UUID(new_job_id()) for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    low_bits = {value.int & ((1 << 62) - 1) for value in ids}
    assert len(low_bits) == len(ids)


def test_the_text_is_the_canonical_lower_case_form() -> None:
    for _ in range(1_000):
        text = new_job_id()
        assert str(uuid.UUID(text)) == text  # 8-4-4-4-12 lower-case hex, as PostgreSQL prints


def test_a_forked_process_never_hands_out_its_parents_random_bits() -> None:
    new_job_id()  # the parent has random bits kept for its next ids
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child writes its ids and exits at once
        os.close(reader)
        os.write(writer, " ".join(new_job_id() for _ in range(8)).encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        childs = pipe.read().split()
    os.waitpid(child, 0)
    parents = [new_job_id() for _ in range(8)]
    random_part = (1 << 74) - 1  # below the time, version and variant
    assert len(childs) == 8
    assert not {uuid.UUID(i).int & random_part for i in childs} & {
        uuid.UUID(i).int & random_part for i in parents
    }
