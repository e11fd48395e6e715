"""The background runner's handling of a run that hangs (tests/background.py): its threads' stacks reach the
failure, a second attempt that passes turns the failure into a warning that still carries them, and nothing the run
started outlives it; nor when the session ends while a run is going (a server it started in a session of its own
included, which the run stops on its way out)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from background import Background, Run

# sleeps in a function of its own, so the stack names it; hangs on the first attempt only (a marker file says which),
# or on every attempt ("always"), after starting a child process that would sleep on (its pid in OUT.child)
HANGS = """
import os, subprocess, sys, time
def wait_forever():
    time.sleep(600)
out, how = sys.argv[1], sys.argv[2]
marker = out + ".started"
if how == "always" or not os.path.exists(marker):
    open(marker, "w").close()
    if how == "always":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(out + ".child", "w").write(str(child.pid))
    wait_forever()
open(out, "w").write("{}")
"""


def _run(how: str) -> tuple[Background, Run]:
    background = Background()
    run = Run("probe", [sys.executable, "-c", HANGS, "{out}", how], timeout_s=3, bind_cpu=False)
    background.start([run])
    return background, run


def test_a_hang_that_does_not_return_passes_with_its_stack_as_a_warning():
    background, _ = _run("once")
    with pytest.warns(UserWarning, match="second attempt") as record:
        assert background.results("probe") == [{}]
    message = str(record[0].message)
    assert "wait_forever" in message and "machine:" in message


def test_a_hang_that_returns_fails_with_both_attempts_stacks_and_leaves_no_process():
    background, run = _run("always")
    with pytest.raises(RuntimeError) as failure:
        background.results("probe")
    assert str(failure.value).count("wait_forever") >= 2 and "first attempt" in str(failure.value)
    assert _ends(Path(f"/proc/{Path(f'{run.out}.child').read_text()}/stat"))


def _ends(stat: Path, within_s: float = 5.0) -> bool:
    """The process is gone, or a zombie its new parent has not reaped yet (state Z), within `within_s` (SIGKILL
    lands asynchronously)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


# starts a child in a session of its own (as a bench command starts its servers) and stops it on its way out
SERVES = """
import subprocess, sys, time
out = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
try:  # the pid is written inside: an interrupt that lands once the test can see it still kills the child
    with open(out + ".child", "w") as pid_file:
        pid_file.write(str(child.pid))
    time.sleep(600)
finally:
    child.kill()
"""


def test_a_session_that_ends_during_a_run_leaves_nothing_the_run_started():
    background = Background()
    run = Run("probe", [sys.executable, "-c", SERVES, "{out}"], timeout_s=600, bind_cpu=False)
    background.start([run])
    child = Path(f"{run.out}.child")
    deadline = time.monotonic() + 60
    while not (child.exists() and child.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    background.stop()
    assert _ends(Path(f"/proc/{child.read_text()}/stat"))
