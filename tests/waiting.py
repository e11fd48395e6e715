"""Waiting in tests for something that happens on its own time (a process exiting, a scrape landing): poll the
condition until it holds, with a deadline only a real failure misses. A short fixed window fails on a busy machine
(on 2 CPUs beside the engines a SIGKILLed process was seen still there after 5 s, and gone a moment later); a poll
returns as soon as the condition holds, so the generous deadline costs nothing when things work."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
EVERY_S = 0.2


def wait_until(condition: Callable[[], T], deadline_s: float, what: str | Callable[[], str]) -> T:
    """`condition()`'s first truthy value, polled every `EVERY_S`; AssertionError naming `what` was not seen once
    `deadline_s` passed (`what` may be a function, called then, to say what was still missing)."""
    deadline = time.monotonic() + deadline_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {deadline_s:g} s: {what() if callable(what) else what}")
        time.sleep(EVERY_S)
    return value
