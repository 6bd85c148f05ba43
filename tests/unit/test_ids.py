"""Job ids are UUIDv7 (RFC 9562 §5.7): time-ordered, random below the time, unique."""

from __future__ import annotations

import time
import uuid

from idemproxy.identity.ids import new_job_id


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
