"""Problem details are one line of text (SPEC §8, RFC 9457 §3.1.4).

A problem's default detail is its class's docstring; it was taken with `strip()` only, so a
docstring over several lines reached clients with its line breaks and source indentation
(`409 outcome-unknown`, a job deleted mid-attempt: "…its attempt ran: the\\n    upstream…").
"""

from __future__ import annotations

import json
import re

import pytest

from idemproxy import errors
from idemproxy.http.problems import problem_response


def _problems(cls: type[errors.ProblemError]) -> list[type[errors.ProblemError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_problems(sub))
    return found


PROBLEMS = sorted(set(_problems(errors.ProblemError)), key=lambda cls: cls.__name__)
_SPACING = re.compile(r"\s{2,}|[\n\r\t]")


def test_every_problem_class_is_found() -> None:
    assert errors.JobLost in PROBLEMS and len(PROBLEMS) > 20


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda cls: cls.__name__)
def test_no_default_detail_holds_a_line_break_or_a_run_of_spaces(
    problem: type[errors.ProblemError],
) -> None:
    error = problem()
    assert error.detail and _SPACING.search(error.detail) is None
    body = problem_response(error).body
    assert isinstance(body, bytes)
    detail = json.loads(body)["detail"]
    assert detail == error.detail


def test_a_given_detail_is_one_line_in_the_response() -> None:
    body = problem_response(errors.InvalidRequest("state must be\n   one of: unknown")).body
    assert isinstance(body, bytes)
    assert json.loads(body)["detail"] == "state must be one of: unknown"


def test_job_lost_reads_as_one_sentence() -> None:
    assert "ran: the upstream may have executed it" in errors.JobLost().detail
