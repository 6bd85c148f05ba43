"""A contract violation's text names the upstream's own member names, and is stored as the
attempt's error (SPEC §3.4): it must be text every store takes. A NUL (PostgreSQL's text
refuses it) or a lone surrogate (a JSON `"\\udce9"`: no UTF-8 holds it) in a member name made
the settle fail, for ever, as a store outage."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from idemproxy.config.settings import ContractSettings
from idemproxy.core.types import Claimed, Intent, JobState
from idemproxy.proxy.upstream.contract import Contract
from idemproxy.store.base import Store

SCHEMA = {"type": "object", "additionalProperties": {"type": "integer"}}
BODY = b'{"a\\u0000b": "x", "caf\\udce9": "y", "ok": 1}'


def _violations(tmp_path: Path) -> list[str]:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    samples_file = tmp_path / "samples.jsonl"
    samples_file.write_text('{"path": "/p"}\n')
    contract = Contract(ContractSettings(schema_file=schema_file, samples_file=samples_file))
    return contract.violations(200, BODY)


def test_member_names_are_written_escaped(tmp_path: Path) -> None:
    violations = _violations(tmp_path)
    assert len(violations) == 2
    assert all(v.isprintable() for v in violations)
    assert sorted(v.split(":")[0] for v in violations) == ["/a\\x00b", "/caf\\udce9"]


async def test_a_violation_is_stored_as_the_attempts_error(tmp_path: Path, store: Store) -> None:
    error = "contract: " + "; ".join(_violations(tmp_path))
    intent = Intent("alice", "k", "fp", "POST", "/p")
    claimed = await store.claim(intent, str(uuid.uuid4()), "primary", ttl=60.0, lease=30.0)
    assert isinstance(claimed, Claimed)
    assert await store.settle(claimed.job, claimed.attempt, JobState.RELEASED, error=error)
    job = await store.get_by_id(claimed.job.id)
    assert job is not None and job.attempts[0].error == error
