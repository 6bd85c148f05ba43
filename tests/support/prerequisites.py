"""What to do when a tool or server a test needs is missing: skip, saying what is missing and
how to get it, so that a contributor with a bare clone can run the rest; or, where everything
is meant to run (CI sets IDEMPROXY_TEST_REQUIRE_ALL=1), fail."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE_ALL = "IDEMPROXY_TEST_REQUIRE_ALL"


def required_everywhere() -> bool:
    return os.environ.get(REQUIRE_ALL, "") not in ("", "0")


def missing(reason: str) -> NoReturn:
    """Skip the test for `reason`, or fail it when every test must run."""
    if required_everywhere():
        pytest.fail(f"{reason} ({REQUIRE_ALL} is set: nothing may be skipped)")
    pytest.skip(reason)
