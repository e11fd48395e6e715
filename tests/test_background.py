"""The background runner's handling of a run that hangs (tests/background.py): its threads' stacks reach the
failure, a second attempt that passes turns the failure into a warning that still carries them, and nothing the run
started outlives it; nor when the session ends while a run is going (a server it started in a session of its own
included, which the run stops on its way out)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from background import BIND, Background, Run
from waiting import wait_until

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


@pytest.fixture(scope="module")
def hanging() -> dict[str, tuple[Background, Run]]:
    """Both probes started at once (each waits out its timeouts; side by side they take one's time, not two)."""
    return {how: _run(how) for how in ("once", "always")}


def _run(how: str) -> tuple[Background, Run]:
    """The probe under a timeout that each hanging attempt waits out in full, yet long enough for a busy machine to
    start Python and reach wait_forever (or, on the attempt that passes, write its result): at 3 s either could be
    late, and then the stack lacks wait_forever or the passing attempt times out too."""
    background = Background()
    run = Run("probe", [sys.executable, "-c", HANGS, "{out}", how], timeout_s=20, bind_cpu=False)
    background.start([run])
    return background, run


def test_a_hang_that_does_not_return_passes_with_its_stack_as_a_warning(hanging):
    background, _ = hanging["once"]
    with pytest.warns(UserWarning, match="second attempt") as record:
        assert background.results("probe") == [{}]
    message = str(record[0].message)
    assert "wait_forever" in message and "machine:" in message


def test_a_hang_that_returns_fails_with_both_attempts_stacks_and_leaves_no_process(hanging):
    background, run = hanging["always"]
    with pytest.raises(RuntimeError) as failure:
        background.results("probe")
    assert str(failure.value).count("wait_forever") >= 2 and "first attempt" in str(failure.value)
    _assert_ends(Path(f"/proc/{Path(f'{run.out}.child').read_text()}/stat"))


def _assert_ends(stat: Path) -> None:
    """The process ends: gone, or a zombie its new parent has not reaped yet (state Z). SIGKILL lands
    asynchronously, and on a busy machine it was seen still running 5 s later: 60 s, which a process that was never
    killed still misses."""

    def ended() -> bool:
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    wait_until(ended, 60, f"the process of {stat} ending")


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
    pid = wait_until(lambda: child.exists() and child.read_text(), 60, f"the run's child's pid in {child}")
    background.stop()
    _assert_ends(Path(f"/proc/{pid}/stat"))


# records the CPU binding it was given and when it ran; with a partner, it first leaves a marker and waits (up to a
# generous deadline) for the partner's: both markers seen means the two ran side by side
RECORDS = """
import json, os, sys, time
out, mine, partner = sys.argv[1:4]
started = time.time()
met = None
if partner:
    open(mine, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(partner) and time.monotonic() < deadline:
        time.sleep(0.05)
    met = os.path.exists(partner)
json.dump({"bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "met": met, "started": started, "ended": time.time()},
          open(out, "w"))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or BIND in os.environ, reason="needs 2 CPUs and no set binding")
def test_once_a_test_waits_the_runs_share_both_cpus_and_a_self_binding_run_goes_alone(tmp_path):
    """Before any test reads a run, one thread runs them on the last CPU; once one waits, a second thread takes the
    queue's next runs on the first CPU, side by side with the first (never two on one CPU); a run that binds itself
    starts only when the runs before it have ended."""
    cpus = {str(cpu) for cpu in (min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0)))}
    background = Background()
    here = {name: str(tmp_path / f"{name}.here") for name in ("second", "third")}
    first = Run("first", [sys.executable, "-c", RECORDS, "{out}", "", ""])
    second = Run("second", [sys.executable, "-c", RECORDS, "{out}", here["second"], here["third"]])
    third = Run("third", [sys.executable, "-c", RECORDS, "{out}", here["third"], here["second"]])
    alone = Run("alone", [sys.executable, "-c", RECORDS, "{out}", "", ""], bind_cpu=False)
    background.start([first, second, third, alone])
    records = [background.results(run.fixture)[0] for run in (first, second, third)]
    (own,) = background.results("alone")
    assert records[1]["met"] and records[2]["met"], records  # side by side
    assert records[1]["bind"] != records[2]["bind"] and {record["bind"] for record in records} == cpus, records
    assert own["bind"] is None and own["started"] >= max(record["ended"] for record in records), (own, records)
    lines = background.timings()
    assert sum("on CPU" in line for line in lines) == 3, lines
