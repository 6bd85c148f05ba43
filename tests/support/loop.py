"""A private event loop for set-up code that sync and async tests share."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_private(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on a loop of its own: a fixture that does this serves sync tests
    and async ones alike (an async test's loop is not running yet when its fixtures set up)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
