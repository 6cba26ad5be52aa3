"""The one way a test waits for something to happen: poll a condition until it holds.

A test never sleeps for a fixed time to let something happen; it names what it awaits, and
a timeout fails with that name (a callable message is called then, to describe the state).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

Message = str | Callable[[], str]


def wait_for(
    condition: Callable[[], object], timeout: float, *, interval: float = 0.05, message: Message
) -> float:
    """Call ``condition`` every ``interval`` seconds until it returns something true; the
    seconds that took. AssertionError naming ``message`` after ``timeout`` seconds."""
    start = time.monotonic()
    while not condition():
        _check_deadline(start, timeout, message)
        time.sleep(interval)
    return time.monotonic() - start


async def wait_for_async(
    condition: Callable[[], object], timeout: float, *, interval: float = 0.01, message: Message
) -> float:
    """``wait_for`` on an event loop: sleeps with asyncio, so that the tasks on this loop
    which make the condition true go on running meanwhile."""
    start = time.monotonic()
    while not condition():
        _check_deadline(start, timeout, message)
        await asyncio.sleep(interval)
    return time.monotonic() - start


def _check_deadline(start: float, timeout: float, message: Message) -> None:
    if time.monotonic() - start >= timeout:
        what = message() if callable(message) else message
        raise AssertionError(f"not within {timeout:g} s: {what}")
