"""Result records for tests that do not send anything."""

from __future__ import annotations

from typing import Any

from idemproxy.batch.input import Item
from idemproxy.batch.keys import identify
from idemproxy.batch.records import Outcome, ResultRecord


def record(item: Item | str, outcome: Outcome = Outcome.DONE, **fields: Any) -> ResultRecord:
    if isinstance(item, str):
        item = Item(item, "POST", "/x", body={"id": item})
    identity = identify(item, fields.pop("prefix", "batch"))
    values: dict[str, Any] = {
        "id": item.id,
        "outcome": outcome,
        "status": 201 if outcome is Outcome.DONE else 422,
        "replayed": False,
        "attempts": 1,
        "body": {"ok": True},
        "body_encoding": "json",
        "content_type": "application/json",
        "error": None,
        "error_code": None,
        "retryable": False,
        "key": identity.key,
        "request_hash": identity.request_hash,
        "meta": None,
        "started_at": "2025-01-01T00:00:00.000Z",
        "finished_at": "2025-01-01T00:00:01.000Z",
    }
    return ResultRecord(**{**values, **fields})
