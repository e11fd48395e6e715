"""Start an OpenAI-compatible server (vanilla vLLM or `kvserve serve`) as a subprocess and wait until it is healthy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvserve.allocator import allocator_env


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
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *common]
    if kind == "kvserve":
        return [sys.executable, "-m", "kvserve.cli", "serve", *common]
    if kind == "vllm-cli":  # vLLM's own `vllm serve`: kvserve's plugin active, none of `kvserve serve`'s defaults
        return [str(Path(sys.executable).with_name("vllm")), "serve", *common]
    raise ValueError(f"server kind must be vanilla, kvserve or vllm-cli, not {kind!r}")


@contextmanager
def running_server(
    kind: str, model: str | None, args: list[str], log_path: Path, env: dict | None = None, startup_timeout: float = 600
) -> Iterator[str]:
    """Yields the base URL; stops the server on exit. Vanilla runs with vLLM's plugins off (`VLLM_PLUGINS=none`)."""
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
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server_command(kind, model, port, args),
            env=server_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.time() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited:\n" + log_path.read_text()[-4000:])
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{kind} server did not come up:\n" + log_path.read_text()[-4000:])
            time.sleep(2)
        yield proc, base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:  # the engine core and worker processes share the server's session
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
