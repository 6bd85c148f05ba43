"""Rows to `Job`s (store/rows.py): the shortcuts give what the plain conversions gave."""

from __future__ import annotations

from typing import Any

import pytest

from idemproxy.core.types import JobState, StoredResponse
from idemproxy.store.rows import decode_headers, encode_headers, job_from_row

HEADERS = (("Content-Type", "application/json"), ("Link", "<a>"), ("Link", "<b>"))


def _row(**changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": "6d7beb65-be60-4f22-82d7-f8cafeb7ad63",
        "owner": "o",
        "key": "k",
        "fingerprint": "f",
        "state": "completed",
        "version": 2,
        "attempt_count": 1,
        "method": "POST",
        "path": "/p",
        "completed_by": 1,
        "response_status": 201,
        "response_headers": encode_headers(HEADERS),
        "response_body": b"{}",
        "response_omitted": False,
        "response_key": None,
        "created_at": 1_700_000_000.0,
        "updated_at": 1_700_000_001.0,
        "expires_at": 1_700_086_400.0,
        "expired": 0,
        "lease_expired": 0,
        "resolution": None,
        "started_by": None,
    }
    return row | changes


def test_stored_headers_decode_the_same_from_text_and_from_a_list_and_again() -> None:
    text = encode_headers(HEADERS)
    assert decode_headers(text) == HEADERS
    assert decode_headers(text) == HEADERS  # parsed once, kept
    assert decode_headers([list(pair) for pair in HEADERS]) == HEADERS
    assert decode_headers(None) == ()


@pytest.mark.parametrize("state", list(JobState))
def test_every_state_is_read(state: JobState) -> None:
    assert job_from_row(_row(state=state.value)).state is state


def test_an_unknown_state_is_an_error() -> None:
    with pytest.raises(ValueError, match="bogus"):
        job_from_row(_row(state="bogus"))


def test_a_row_becomes_a_job() -> None:
    job = job_from_row(_row())
    assert (job.id, job.version, job.expired, job.lease_expired) == (_row()["id"], 2, False, False)
    assert isinstance(job.response, StoredResponse) and job.response.headers == HEADERS
    assert job.response.body == b"{}"
    assert job.created_at is not None and job.created_at.timestamp() == 1_700_000_000.0


def test_stored_headers_are_compact_ascii_json_as_rows_written_before_hold_them() -> None:
    # The text of rows already stored (and the pgbench script's): a change would still decode,
    # but two proxies of different versions must write the same column.
    headers = (("Content-Type", "text/plain"), ("X-Caf\u00e9", 'cr\u00e8me "br\u00fbl\u00e9e"'))
    expected = (
        '[["Content-Type","text/plain"],["X-Caf\\u00e9","cr\\u00e8me \\"br\\u00fbl\\u00e9e\\""]]'
    )
    assert encode_headers(headers) == expected
    assert encode_headers(()) == "[]"
    assert decode_headers(encode_headers(headers)) == headers
