"""SPEC §8: every problem says where its client stands (`instance`, `job_state`, `retry`), and
every code has its anchor in docs/problems.md, which `type` points at once it is published."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from idemproxy import errors
from idemproxy.http.problems import problem_response

DOCS = Path(__file__).resolve().parents[2] / "docs" / "problems.md"
_RETRY = {"same-key", "new-key-safe", "never"}


def _problems(cls: type[errors.ProblemError]) -> list[type[errors.ProblemError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_problems(sub))
    return found


PROBLEMS = sorted(set(_problems(errors.ProblemError)), key=lambda cls: cls.__name__)
GOVERNED = [cls for cls in PROBLEMS if not issubclass(cls, errors.OperatorError)]
# The rule SPEC §8 gives each code, for a request that has no job.
RULES = {
    "key-missing": "new-key-safe",
    "key-invalid": "new-key-safe",
    "header-invalid": "new-key-safe",
    "path-invalid": "new-key-safe",
    "owner-missing": "new-key-safe",
    "owner-unstable": "new-key-safe",
    "payload-mismatch": "new-key-safe",
    "no-route": "new-key-safe",
    "body-too-large": "new-key-safe",
    "body-invalid": "new-key-safe",
    "expectation-failed": "new-key-safe",
    "body-encoding-unsupported": "new-key-safe",
    "signature-invalid": "new-key-safe",
    "key-not-found": "new-key-safe",
    "identity-unavailable": "same-key",
    "response-unreadable": "same-key",
    "encoding-not-acceptable": "same-key",
    "request-in-flight": "same-key",
    "request-timeout": "same-key",
    "client-disconnected": "same-key",
    "store-unavailable": "same-key",
    "too-many-waiters": "same-key",
    "shutting-down": "same-key",
    "quota-exceeded": "same-key",
    "upstream-unavailable": "same-key",
    "internal-error": "same-key",
    "outcome-unknown": "never",
    "contract-violation": "never",
    "upstream-timeout": "never",
}


def _body(error: errors.ProblemError, types: str | None = None) -> dict[str, Any]:
    raw = problem_response(error, types=types).body
    assert isinstance(raw, bytes)
    parsed: dict[str, Any] = json.loads(raw)
    return parsed


def _anchors() -> set[str]:
    return set(re.findall(r'<a id="([a-z-]+)"></a>', DOCS.read_text()))


def test_every_code_has_a_rule() -> None:
    assert {cls.code for cls in GOVERNED} == set(RULES)


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda cls: cls.__name__)
def test_every_code_has_its_anchor_and_type(problem: type[errors.ProblemError]) -> None:
    assert problem.code in _anchors()
    base = "https://docs.example.com/idemproxy/problems"
    assert _body(problem(), base)["type"] == f"{base}#{problem.code}"
    assert _body(problem())["type"] == f"urn:idemproxy:problem:{problem.code}"


@pytest.mark.parametrize("problem", GOVERNED, ids=lambda cls: cls.__name__)
def test_without_a_job(problem: type[errors.ProblemError]) -> None:
    body = _body(problem())
    assert "instance" not in body
    assert body["job_state"] == "none"  # e.g. a pass-through request's upstream-timeout
    assert body["retry"] == RULES[problem.code]


@pytest.mark.parametrize("problem", GOVERNED, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("state", ["in_flight", "completed", "released", "unknown"])
def test_about_a_job(problem: type[errors.ProblemError], state: str) -> None:
    body = _body(problem().about("0190c6f2-0000-7000-8000-000000000001", state))
    if problem.fixed_state == "none":  # quota-exceeded: refused before any claim (SPEC §8)
        assert "instance" not in body and body["job_state"] == "none"
    else:
        assert body["instance"] == "urn:idemproxy:job:0190c6f2-0000-7000-8000-000000000001"
        assert body["job_state"] == (problem.fixed_state or state)
    expected = "never" if body["job_state"] == "unknown" else RULES[problem.code]
    assert body["retry"] == expected and expected in _RETRY


def test_a_claim_refused_after_a_job_was_forgotten_names_no_job() -> None:
    """A re-claim's store-unavailable is about no job, not the forgotten one it is raised under
    (core/machine.py: a claim afresh after `NeedForget`)."""
    error = errors.StoreUnavailable().about_no_job().about("forgotten", "completed")
    body = _body(error)
    assert "instance" not in body and body["job_state"] == "none" and body["retry"] == "same-key"


def test_a_job_named_first_is_kept() -> None:
    error = errors.UpstreamUnavailable().about("first", "released").about("second", "in_flight")
    assert _body(error)["instance"] == "urn:idemproxy:job:first"
    assert _body(error)["retry"] == "same-key"


@pytest.mark.parametrize(
    "problem", [cls for cls in PROBLEMS if issubclass(cls, errors.OperatorError)]
)
def test_operator_problems_carry_no_client_standing(problem: type[errors.ProblemError]) -> None:
    body = _body(problem())
    assert "job_state" not in body and "retry" not in body
