"""The test helpers' ports (tests/support/ports.py): the xdist workers of `scripts/test` choose
ports at the same time, and no two of them may ever be handed the same one."""

from __future__ import annotations

import subprocess
import sys

from tests.support.ports import free_port

COUNT = 200
# Claims COUNT ports, prints them, and holds them (as a test worker does) until stdin closes.
_OTHER_WORKER = f"""
import sys
from tests.support.ports import free_port
print(*[free_port() for _ in range({COUNT})], flush=True)
sys.stdin.read()
"""


def test_ports_claimed_by_another_process_are_never_handed_out() -> None:
    other = subprocess.Popen(
        [sys.executable, "-c", _OTHER_WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    with other:
        assert other.stdout is not None and other.stdin is not None
        mine = {free_port() for _ in range(COUNT)}
        theirs = {int(port) for port in other.stdout.readline().split()}
        mine |= {free_port() for _ in range(COUNT)}  # while the other still holds its ports
        other.stdin.close()
    assert len(theirs) == COUNT
    assert len(mine) == 2 * COUNT  # never the same port twice in one process either
    assert not mine & theirs
