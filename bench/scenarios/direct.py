"""The backend direct: the baseline of every ratio, measured in every run whatever --only says."""

from __future__ import annotations

from model import Scenario
from runner import Bench, Step

DIRECT = Scenario("direct", "backend direct (POST)", "backend", "post.lua")


def run(bench: Bench) -> None:
    bench.measure(DIRECT)


STEP = Step("direct", (DIRECT,), run, always=True)
