"""How `kvserve calibrate` stops: its server's start-up waits while the server's log moves and fails when the server
exits or its log stands still (fake servers, no vLLM); a KeyboardInterrupt during that wait ends the server's whole
process group; and the command itself, interrupted (SIGINT, SIGTERM) while its server starts on a tiny model, ends
every process it started and says how to resume, without a traceback."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from waiting import wait_until

from kvserve.profile import PROFILES_ENV
from kvserve.tools.bench.servers import ServerStartError, server_process, wait_until_serving
from kvserve.tools.bench.tiny_models import tiny_model

STALL_LIMIT_S = 2.0
WRITING_S = 3 * STALL_LIMIT_S  # a fake server logs for longer than the stall limit, so a fixed deadline would fail


def fake_server(script: str) -> list[str]:
    return [sys.executable, "-c", script]


SILENT_SERVER = fake_server("import time; time.sleep(600)")


def log_line(log: Path, line: str) -> None:
    with log.open("a") as out:
        out.write(line + "\n")


def logging_on_each_poll(log: Path, seconds: float, then: Callable[[], bool]) -> Callable[[], bool]:
    """A health check that logs a line on the server's behalf each time the wait polls it, for `seconds`, then asks
    `then`. The wait itself drives the log, so how busy the machine is cannot make the log look still early (a fake
    server printing on its own clock could be starved past the stall limit on a loaded CI machine)."""
    started = time.monotonic()

    def healthy() -> bool:
        if time.monotonic() - started < seconds:
            log_line(log, "compiling")
            return False
        return then()

    return healthy


def live_members(groups: set[int]) -> list[psutil.Process]:
    """Processes of these process groups that still run (zombies wait only for their reaping)."""
    alive = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) in groups and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return alive


def test_a_start_up_that_keeps_logging_is_waited_for_past_the_stall_limit(tmp_path):
    log = tmp_path / "server.log"
    with server_process(SILENT_SERVER, dict(os.environ), log) as proc:
        started = time.monotonic()
        wait_until_serving(proc, log, logging_on_each_poll(log, WRITING_S, lambda: True), STALL_LIMIT_S, poll_s=0.1)
        assert time.monotonic() - started > STALL_LIMIT_S  # it waited longer than the limit: the log was moving


def test_a_start_up_whose_log_stands_still_fails_naming_the_log(tmp_path):
    log = tmp_path / "server.log"

    def then_silent() -> bool:
        if "silent from now on" not in log.read_text():
            log_line(log, "silent from now on")
        return False

    with server_process(SILENT_SERVER, dict(os.environ), log) as proc:
        with pytest.raises(ServerStartError) as stalled:
            wait_until_serving(proc, log, logging_on_each_poll(log, WRITING_S, then_silent), STALL_LIMIT_S, poll_s=0.1)
        assert "silent from now on" in log.read_text()  # it gave up only after the log had stopped
    assert "logged nothing for 2 s" in stalled.value.what and stalled.value.log_path == log


def test_a_server_that_exits_during_start_up_fails_with_its_status(tmp_path):
    log = tmp_path / "server.log"
    with server_process(fake_server("print('no such model'); raise SystemExit(3)"), dict(os.environ), log) as proc:
        with pytest.raises(ServerStartError) as exited:
            wait_until_serving(proc, log, lambda: False, STALL_LIMIT_S, poll_s=0.1)
    assert "exited with status 3" in exited.value.what and "no such model" in str(exited.value)


def test_an_interrupt_during_start_up_ends_the_servers_whole_process_group(tmp_path):
    """The fake server starts a child (as vLLM's API server starts its engine core), then Ctrl-C arrives while the
    wait polls: neither process outlives the block."""
    log = tmp_path / "server.log"
    command = fake_server(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print('engine started', flush=True)\n"
        "time.sleep(600)\n"
    )

    def interrupt_once_the_engine_runs() -> bool:
        if "engine started" in log.read_text():
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        with server_process(command, dict(os.environ), log) as proc:
            group = os.getpgid(proc.pid)
            wait_until_serving(proc, log, interrupt_once_the_engine_runs, 600, poll_s=0.1)
    wait_until(lambda: not live_members({group}), 60, f"the fake server's group {group} ended")


def test_calibrate_interrupted_while_its_server_starts_leaves_nothing_running(tmp_path):
    """`kvserve calibrate` on the tiny Qwen2 model, interrupted once its server's engine core runs (mid start-up), by
    Ctrl-C and by SIGTERM (two calibrations side by side, each with its own profiles folder): each exits with 128 +
    the signal, says what stopped, where the server's log is and the command that resumes, shows no traceback, and
    no process it started (its own session, the server's) outlives it."""
    model_dir = tiny_model("qwen2")
    argv = [str(model_dir), "--roles-samples", "2", "--tasks", "passkey", "--lengths", "400", "--samples", "2"]
    argv += ["--policies", "snapkv", "--budgets", "64", "--quiet"]
    runs, groups = {}, set()
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            folder = tmp_path / signum.name
            folder.mkdir()
            env = dict(os.environ, **{PROFILES_ENV: str(folder)}, VLLM_CPU_KVCACHE_SPACE="1")
            with open(folder / "stderr.txt", "w") as stderr:
                calibrate = subprocess.Popen(
                    [sys.executable, "-m", "kvserve.cli", "calibrate", *argv],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    start_new_session=True,
                )
            groups.add(calibrate.pid)
            runs[signum] = (calibrate, folder)
        for signum, (calibrate, folder) in runs.items():
            server_log = folder / f"{model_dir.name}.work" / "server.log"
            server = poll_for_server_with_engine(calibrate, server_log)
            groups.add(os.getpgid(server.pid))
            assert "Application startup complete" not in server_log.read_text()  # still starting
            calibrate.send_signal(signum)
        for signum, (calibrate, folder) in runs.items():
            returncode = calibrate.wait(timeout=300)
            said = (folder / "stderr.txt").read_text()
            server_log = folder / f"{model_dir.name}.work" / "server.log"
            assert returncode == 128 + signum, said
            assert "Traceback" not in said, said
            assert f"Resume with: {PROFILES_ENV}={folder} kvserve calibrate {shlex.join(argv)}" in said, said
            assert "stopped during the check's server start-up: interrupted" in said and str(server_log) in said, said
        wait_until(lambda: not live_members(groups), 60, f"no process of calibrate's or its servers' groups {groups}")
    finally:  # a failing run leaves nothing behind either
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


def poll_for_server_with_engine(calibrate: subprocess.Popen, server_log: Path) -> psutil.Process:
    """The calibration's server once its log has begun and its engine core runs: the middle of its start-up."""

    def server_with_engine() -> psutil.Process | None:
        assert calibrate.poll() is None, "calibrate exited before its server started"
        if not (server_log.exists() and server_log.stat().st_size):
            return None
        for child in psutil.Process(calibrate.pid).children():
            try:
                if child.children():  # the API server has started its engine core
                    return child
            except psutil.NoSuchProcess:
                pass
        return None

    return wait_until(server_with_engine, 900, "the check's server started its engine core")
