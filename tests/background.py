"""Subprocess runs that tests only read (an engine with other settings, the model matrix, pipeline stages), run in the
background while this process runs the in-process engine's tests.

Each such engine is a process of its own (vLLM picks its attention implementation, plugins and parallelism once per
process), and vLLM's CPU worker computes on one thread, so run inside their module fixtures one after another they
left the machine's second CPU idle for minutes. A test module declares its runs (`background_runs()`, returning
`Run`s, each named after the fixture that reads it); once the session's tests are collected, conftest starts the
runs some collected test needs, one after another in a thread, in the order the tests come; the fixture then waits
for its run's JSON.

vLLM binds a CPU worker's threads to CPUs it picks the same way in every process (`VLLM_CPU_OMP_THREADS_BIND=auto`:
the first CPU of a 2-CPU machine, where the in-process engine's worker, i.e. this process, already computes), so
the runs are bound to the last CPU this process may use, unless the user chose a binding or the run binds itself.
The tests that read runs come last, so once the first of them waits this process's CPU is idle: a second thread then
takes runs from the same queue, in the same order, bound to the first CPU (no run starts later than with one thread,
so no test waits longer). A run that binds itself (to both CPUs) runs alone.

A run that outlives its timeout is not simply killed: Python's fault handler (on in every run) first prints the stack
of each of its threads into its log, and the failure names the machine and what else was running, so a hang seen
only on some CI machine says where it hung. It is then started once more; if that attempt passes, the test passes
with a warning that carries the first attempt's stacks (a hang that does not come back is still reported).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BIND = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass
class Run:
    fixture: str  # the fixture that reads this run's result (a run starts only if a collected test uses it)
    argv: list[str]  # the command; "{out}" in an argument is replaced by the JSON file it must write
    env: dict[str, str | None] = field(default_factory=dict)  # changes to this process's environment (None: unset)
    prepare: Callable[[], None] | None = None  # called in the thread before the command (e.g. files it reads)
    bind_cpu: bool = True  # bind vLLM's worker threads to the CPU this process leaves (False: the run binds itself)
    timeout_s: int = 900
    # filled in by Background
    hung: str | None = None  # the diagnosis of a first attempt that timed out, when the second one passed
    seconds: float = 0.0  # how long its attempts ran
    cpu: str = ""  # the CPU its worker threads were bound to ("" : the run's own binding)
    waited: float = 0.0  # how long the tests that read it waited for it
    out: Path | None = None
    log: Path | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Background:
    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="kvserve-tests-background-"))
        self.runs: dict[str, list[Run]] = {}
        self.queue: deque[Run] = deque()
        self.changed = threading.Condition()  # guards queue, running, alone, processes, threads, stopped
        self.running = 0  # runs going now
        self.alone = False  # the run going binds itself: no other starts beside it
        self.processes: set[subprocess.Popen] = set()
        self.threads: list[threading.Thread] = []
        self.stopped = False

    def start(self, runs: list[Run]) -> None:
        for number, run in enumerate(runs):
            run.out = self.folder / f"{number}-{run.fixture}.json"
            run.log = run.out.with_suffix(".log")
            self.runs.setdefault(run.fixture, []).append(run)
        self.queue.extend(runs)
        self._add_worker(-1)

    def _add_worker(self, cpu: int) -> None:
        """A thread that runs the queue's runs in order, binding them to this process's CPU number `cpu`."""
        thread = threading.Thread(target=self._work, args=(cpu,), name=f"background-runs-{cpu}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _work(self, cpu: int) -> None:
        while (run := self._take()) is not None:
            try:
                self._run(run, cpu)
            except Exception as error:  # noqa: BLE001 - the fixture that reads it reports it
                run.error = f"{type(error).__name__}: {error}"
            finally:
                with self.changed:
                    self.running -= 1
                    self.alone = False
                    self.changed.notify_all()
                run.done.set()

    def _take(self) -> Run | None:
        """The queue's next run once it may start (None when the queue is done or the session ended): in order,
        never beside a run that binds itself, and one that binds itself only when nothing else runs."""
        with self.changed:
            while not self.stopped and self.queue:
                run = self.queue[0]
                if not self.alone and (run.bind_cpu or self.running == 0):
                    self.queue.popleft()
                    self.running += 1
                    self.alone = not run.bind_cpu
                    return run
                self.changed.wait()
            return None

    def _run(self, run: Run, cpu: int) -> None:
        started = time.monotonic()
        if run.prepare is not None:
            run.prepare()
        error, timed_out = self._attempt(run, cpu)
        if timed_out and not self.stopped:
            first = error
            error, _ = self._attempt(run, cpu)
            if error is None:
                run.hung = first
            else:
                error = f"{error}\n\nfirst attempt:\n{first}"
        run.error = error
        run.seconds = time.monotonic() - started

    def _attempt(self, run: Run, cpu: int) -> tuple[str | None, bool]:
        """Run the command once: (the failure with the log's end, or None; whether it outlived its timeout)."""
        env = dict(os.environ)
        cpus = sorted(os.sched_getaffinity(0))
        if run.bind_cpu and len(cpus) > 1:
            env.setdefault(BIND, str(cpus[cpu]))
        run.cpu = env.get(BIND, "") if run.bind_cpu else ""
        for key, value in run.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT then prints every thread's Python stack
        argv = [arg.replace("{out}", str(run.out)) for arg in run.argv]
        busy = None  # what the machine was doing when the run timed out
        started = time.monotonic()
        with open(run.log, "w") as log:
            # a session of its own: what it started (a bench command's servers) goes with it when it is killed
            process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            with self.changed:
                self.processes.add(process)
                if self.stopped:  # the session ended while it was starting: stopped as `stop` stops the others
                    process.send_signal(signal.SIGINT)
            try:
                code = process.wait(timeout=run.timeout_s)
            except subprocess.TimeoutExpired:
                busy = f"machine: {machine_line()}; load {os.getloadavg()}; processes:\n{_processes()}"
                process.send_signal(signal.SIGABRT)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                code = f"killed (timeout {run.timeout_s} s; its threads' stacks end the log)"
            finally:
                _kill_group(process)
                with self.changed:
                    self.processes.discard(process)
        if code == 0:
            return None, False
        failure = f"{' '.join(argv[1:2])} exited {code} after {time.monotonic() - started:.0f} s:\n"
        failure += run.log.read_text()[-6000:]
        return (failure, False) if busy is None else (f"{failure}\n{busy}", True)

    def results(self, fixture: str) -> list[dict]:
        """The JSON of each run `fixture` declared, waiting for them to finish (RuntimeError with the log if one
        failed)."""
        runs = self.runs.get(fixture)
        if not runs:
            raise RuntimeError(f"no background run for fixture {fixture!r} was started (see tests/background.py)")
        self._share_this_cpu()
        for run in runs:
            waiting = time.monotonic()
            run.done.wait()
            run.waited += time.monotonic() - waiting
            if run.error is not None:
                raise RuntimeError(f"background run for {fixture} failed: {run.error}")
            if run.hung is not None:
                message = f"background run for {fixture} passed on its second attempt; the first: {run.hung}"
                warnings.warn(message, stacklevel=2)
        return [json.loads(run.out.read_text()) for run in runs]

    def _share_this_cpu(self) -> None:
        """A test waits for a run: from now on this process's CPU mostly idles (the readers come last), so a second
        thread takes runs too, bound to the first CPU (not when the user chose the binding, or with one CPU)."""
        cpus = sorted(os.sched_getaffinity(0))
        with self.changed:
            if len(self.threads) != 1 or len(cpus) < 2 or BIND in os.environ or self.stopped:
                return
            self._add_worker(0)

    def printed(self, fixture: str) -> str:
        """What the runs of `fixture` printed (stdout and stderr), once they finished."""
        self.results(fixture)
        return "".join(run.log.read_text() for run in self.runs[fixture])

    def timings(self) -> list[str]:
        """A line per run: how long it ran and how long its readers waited (the suite's length is the longer of
        the in-process tests and this queue; what the readers waited is what the queue added)."""
        runs = [run for group in self.runs.values() for run in group]
        lines = [
            f"{run.fixture}: ran {run.seconds:.0f} s{f' on CPU {run.cpu}' if run.cpu else ''}, waited for "
            f"{run.waited:.0f} s"
            for run in runs
        ]
        return lines + [f"background runs in all: {sum(run.seconds for run in runs):.0f} s"] if runs else []

    def stop(self) -> None:
        """The session ends (a run may still be going when it ends early, as under `pytest -x`): the run is
        interrupted first, so that a bench command stops the servers it started (each in a session of its own, out
        of reach of the group kill), then whatever is left in its session is killed."""
        with self.changed:
            self.stopped = True
            left, processes = list(self.queue), list(self.processes)
            self.queue.clear()
            self.changed.notify_all()
        for run in left:  # never started: a fixture still asking is told so rather than left waiting
            run.error = "the session ended before it started"
            run.done.set()
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in processes:
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
            _kill_group(process)


def _kill_group(process: subprocess.Popen) -> None:
    """Kill every process left in the run's session (the run itself, if it still runs, and what it started)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the session is empty: nothing was left


def machine_line() -> str:
    """The machine in one line (CPU model, cores, the flags that pick vLLM's CPU path), as result files name it."""
    from kvserve.provenance import describe_machine, machine

    return describe_machine(machine())


def _processes() -> str:
    """The busiest processes, for the failure of a run that timed out (was the machine busy, and with what?)."""
    listing = subprocess.run(
        ["ps", "-eo", "pid,ppid,stat,pcpu,rss,etime,args", "--sort=-pcpu"], capture_output=True, text=True
    ).stdout
    return "\n".join(line[:200] for line in listing.splitlines()[:12])
