"""Start an OpenAI-compatible server (vanilla vLLM or `kvserve serve`) as a subprocess and wait until it is healthy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvserve.allocator import allocator_env
from kvserve.server.launch import VLLM_SERVE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(kind: str, model: str | None, port: int, args: list[str]) -> list[str]:
    """The command line of a server; `model=None` (kvserve only) serves the default model the way `kvserve serve`
    does without MODEL (converted once, served as SmolLM2-135M-Instruct)."""
    if model is None and kind != "kvserve":
        raise ValueError("only kvserve serves a default model; name the model for vanilla vLLM")
    common = [*(["--model", model] if model else []), "--host", "127.0.0.1", "--port", str(port), *args]
    if kind == "vanilla":
        return [*VLLM_SERVE, *common]
    if kind == "kvserve":
        return [sys.executable, "-m", "kvserve.cli", "serve", *common]
    if kind == "vllm-cli":  # vLLM's own `vllm serve`: kvserve's plugin active, none of `kvserve serve`'s defaults
        return [str(Path(sys.executable).with_name("vllm")), "serve", *common]
    raise ValueError(f"server kind must be vanilla, kvserve or vllm-cli, not {kind!r}")


@contextmanager
def running_server(
    kind: str, model: str | None, args: list[str], log_path: Path, env: dict | None = None, startup_timeout: float = 600
) -> Iterator[str]:
    """Yields the base URL; stops the server on exit. Vanilla runs with vLLM's plugins off (`VLLM_PLUGINS=none`).
    `startup_timeout` is how long the server's log may stand still before its start-up counts as stuck: there is no
    deadline for the start-up as a whole, which on a busy machine (a compile beside other work) takes what it takes."""
    with running_server_process(kind, model, args, log_path, env, startup_timeout) as (_, base):
        yield base


@contextmanager
def running_server_process(
    kind: str, model: str | None, args: list[str], log_path: Path, env: dict | None = None, startup_timeout: float = 600
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`running_server`, also yielding the API server's process (tests that kill its engine need it)."""
    port = free_port()
    server_env = dict(os.environ, **(env or {}))
    server_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    server_env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # kvserve makes a fresh one; vanilla needs none
    if kind == "vanilla":
        from kvserve.parallelism import parallel_env

        server_env["VLLM_PLUGINS"] = "none"
        server_env.update(allocator_env(server_env)[0])  # the allocator `kvserve serve` would choose
        server_env.update(parallel_env(args, server_env))  # and the CPUs it would give each parallel worker
    base = f"http://127.0.0.1:{port}"
    with server_process(server_command(kind, model, port, args), server_env, log_path) as proc:
        wait_until_serving(proc, log_path, lambda: healthy(base), startup_timeout, kind)
        try:
            yield proc, base
        except httpx.TransportError as error:  # a request failed in transport: say why from its log (a temporary one)
            state = "running" if proc.poll() is None else f"exited with status {proc.returncode}"
            what = (
                "did not answer a request in time" if isinstance(error, httpx.TimeoutException) else "dropped a request"
            )
            raise ServerRequestError(
                f"{kind} server {what} ({type(error).__name__}: {error}; it is {state}):\n{log_tail(log_path)}"
            ) from error


class ServerStartError(RuntimeError):
    """The server exited, or its log stood still, before it served `/health`. `what` says which in a few words,
    `log_path` where its log is; the message adds the log's end."""

    def __init__(self, kind: str, what: str, log_path: Path) -> None:
        self.what, self.log_path = what, log_path
        super().__init__(f"{kind} server {what} (log: {log_path}):\n{log_tail(log_path)}".lstrip())


class ServerRequestError(RuntimeError):
    """A started server closed a request's connection without an answer, or did not answer within the client's
    timeout (the message says which); the message ends with its log's end."""


def log_tail(log_path: Path, chars: int = 4000) -> str:
    return log_path.read_text(errors="replace")[-chars:] if log_path.exists() else "(no log)"


@contextmanager
def server_process(command: list[str], env: dict, log_path: Path) -> Iterator[subprocess.Popen]:
    """The command in a session of its own, its output in `log_path`. However the block ends (an error, Ctrl-C, a
    SIGTERM a handler turned into an exception), the whole process group ends with it: engine core and workers too."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop_process_group(proc)


def wait_until_serving(
    proc: subprocess.Popen,
    log_path: Path,
    healthy: Callable[[], bool],
    stall_limit: float,
    kind: str = "",
    poll_s: float = 2.0,
) -> None:
    """Return once `healthy()`. Raise ServerStartError when the process exits first, or when its log has not grown for
    `stall_limit` seconds: a server compiling beside other work is slow but logs as it goes (a fixed deadline expired
    with such a server seconds from ready), while one that hangs logs nothing."""
    last_size, last_growth = -1, time.monotonic()
    while True:
        if proc.poll() is not None:
            raise ServerStartError(kind, f"exited with status {proc.returncode} during start-up", log_path)
        if healthy():
            return
        size = log_path.stat().st_size if log_path.exists() else 0
        if size != last_size:
            last_size, last_growth = size, time.monotonic()
        elif time.monotonic() - last_growth > stall_limit:
            raise ServerStartError(kind, f"logged nothing for {stall_limit:.0f} s during start-up", log_path)
        time.sleep(poll_s)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the process's group, then SIGKILL to it however the wait ends: a second Ctrl-C during the grace
    period (an operator who sees nothing happen) must not leave the engine core and workers running."""
    try:
        _signal_group(proc, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _signal_group(proc, signal.SIGKILL)  # the engine core and worker processes share the server's session
        proc.wait()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):  # the group has ended (macOS: PermissionError for a zombie leader)
        pass


def healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
