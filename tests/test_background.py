"""The background runner's handling of a run that hangs (tests/background.py): its threads' stacks reach the
failure, and a second attempt that passes turns the failure into a warning that still carries them."""

from __future__ import annotations

import sys

import pytest
from background import Background, Run

# sleeps in a function of its own, so the stack names it; hangs on the first attempt only (a marker file says which)
HANGS_ONCE = """
import os, sys, time
def wait_forever():
    time.sleep(600)
marker = sys.argv[1] + ".started"
if not os.path.exists(marker) or sys.argv[2] == "always":
    open(marker, "w").close()
    wait_forever()
open(sys.argv[1], "w").write("{}")
"""


def _run(how: str) -> Background:
    background = Background()
    background.start([Run("probe", [sys.executable, "-c", HANGS_ONCE, "{out}", how], timeout_s=3, bind_cpu=False)])
    return background


def test_a_hang_that_does_not_return_passes_with_its_stack_as_a_warning():
    background = _run("once")
    with pytest.warns(UserWarning, match="second attempt") as record:
        assert background.results("probe") == [{}]
    message = str(record[0].message)
    assert "wait_forever" in message and "machine:" in message


def test_a_hang_that_returns_fails_with_both_attempts_stacks():
    background = _run("always")
    with pytest.raises(RuntimeError) as failure:
        background.results("probe")
    assert str(failure.value).count("wait_forever") >= 2 and "first attempt" in str(failure.value)
