"""`python -m kvserve.tools.bench crash`: what a server does when its engine dies anyway (a bug nobody has found yet).

Starts `kvserve serve`, puts requests in flight, kills the engine-core process (on CPU it hosts the model worker)
with SIGKILL, and measures how long until `/health` stops answering 200, until the in-flight requests end, and until
the server process exits, with its exit code. A supervisor (`docker run --restart=on-failure`, systemd
`Restart=on-failure`, Kubernetes) can only restart a server that says it is broken: the process must exit non-zero,
and `/health` (the image's HEALTHCHECK) must fail. The exit status of this command is non-zero when either does not
hold within the limits.

    python -m kvserve.tools.bench crash --out crash.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvserve.provenance import command_line, provenance

ENGINE_PROCESS = "EngineCore"  # vLLM names its engine-core process VLLM::EngineCore


def engine_process(server_pid: int) -> psutil.Process:
    """The server's engine-core process (vLLM sets its title to VLLM::EngineCore)."""
    for child in psutil.Process(server_pid).children(recursive=True):
        if ENGINE_PROCESS in " ".join(child.cmdline()) or ENGINE_PROCESS in child.name():
            return child
    raise RuntimeError(f"no {ENGINE_PROCESS} process under server pid {server_pid}")


def _send_in_flight(
    base: str, model: str, count: int, results: list[Any]
) -> tuple[list[threading.Thread], list[threading.Event]]:
    """`count` long streamed completions, each in a thread; each appends what became of it. The events: each is set
    once its stream has a first line (the request is decoding) or it ended without one."""
    streaming = [threading.Event() for _ in range(count)]

    def one(streams: threading.Event) -> None:
        body = {
            "model": model,
            "prompt": "Count: one, two, three,",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
                lines = []
                for line in response.iter_lines():
                    lines.append(line)
                    streams.set()
                error_event = any(x.startswith("data: {") and '"error"' in x for x in lines)
                results.append(
                    {
                        "status": response.status_code,
                        "error_event": error_event,
                        "completed": "data: [DONE]" in lines and not error_event,
                    }
                )
        except httpx.HTTPError as error:
            results.append({"status": None, "transport_error": type(error).__name__})
        finally:
            streams.set()

    threads = [threading.Thread(target=one, args=(event,), daemon=True) for event in streaming]
    for thread in threads:
        thread.start()
    return threads, streaming


def _health(base: str, timeout: float = 2) -> int | None:
    try:
        return httpx.get(base + "/health", timeout=timeout).status_code
    except httpx.HTTPError:
        return None


def _first(probe, good, limit_s: float):
    """`probe()` until `good` of it or `limit_s` passed (then its last value): a busy machine can be slow to answer
    a server that is healthy, so what is measured before the kill is not one try against a short timeout."""
    deadline = time.monotonic() + limit_s
    while not good(value := probe()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def kill_engine_and_measure(
    proc, base: str, model: str, in_flight: int = 2, limit_s: float = 120, healthcheck: list[str] | None = None
) -> dict[str, Any]:
    """Kill the engine of the running server (`proc`, its API server process) with requests in flight; times are
    seconds from the kill. `healthcheck`: a command run before the kill and after /health failed (its exit codes)."""
    report: dict[str, Any] = {"health_before": _first(lambda: _health(base, timeout=30), lambda c: c == 200, limit_s)}
    if healthcheck:
        report["healthcheck_exit_before"] = _first(lambda: _run_healthcheck(healthcheck), lambda c: c == 0, limit_s)
    results: list[Any] = []
    threads, streaming = _send_in_flight(base, model, in_flight, results)
    started = time.monotonic()
    for event in streaming:  # they are decoding (under load, that can take far longer than the few seconds it takes)
        event.wait(timeout=max(0.0, limit_s - (time.monotonic() - started)))
    engine = engine_process(proc.pid)
    report["engine_pid"] = engine.pid
    killed = time.monotonic()
    engine.send_signal(signal.SIGKILL)
    report["health_failed_s"] = None

    def health_failed() -> None:
        report["health_failed_s"] = time.monotonic() - killed
        if healthcheck:
            report["healthcheck_exit_after"] = _run_healthcheck(healthcheck)

    while time.monotonic() - killed < limit_s and proc.poll() is None:
        if report["health_failed_s"] is None and _health(base) != 200:
            health_failed()
        time.sleep(0.1)
    if proc.poll() is not None:
        report["exit_s"] = time.monotonic() - killed
        if report["health_failed_s"] is None:  # it exited between two polls: /health is gone with it
            health_failed()
    report["exit_code"] = proc.poll()
    for thread in threads:
        thread.join(timeout=max(1.0, limit_s - (time.monotonic() - killed)))
    report["in_flight"] = results
    report["passed"] = (
        report["health_before"] == 200
        and report["health_failed_s"] is not None
        and report["exit_code"] not in (None, 0)
        and len(results) == in_flight
        and not any(r.get("completed") for r in results)  # none claims it finished
        and (
            not healthcheck or (report["healthcheck_exit_before"] == 0 and report.get("healthcheck_exit_after", 0) != 0)
        )
    )
    return report


def image_healthcheck(port: int, dockerfile: Path) -> list[str]:
    """The image's HEALTHCHECK command (docker/Dockerfile), pointed at `port`, to run here as the container would."""
    lines = dockerfile.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("HEALTHCHECK"))
    command = " ".join(line.rstrip("\\").strip() for line in lines[start : start + 2]).split(" CMD ", 1)[1]
    argv = shlex.split(command.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
    return [sys.executable if argv[0] == "python3" else argv[0], *argv[1:]]


def _run_healthcheck(command: list[str]) -> int:
    return subprocess.run(command, capture_output=True, timeout=30).returncode


def main(argv: list[str] | None = None) -> None:
    from kvserve.model import default_model_dir
    from kvserve.tools.bench.servers import running_server_process

    parser = argparse.ArgumentParser(
        prog="kvserve bench crash", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--in-flight", type=int, default=2, help="streamed requests running when the engine dies")
    parser.add_argument("--server-args", default="--max-model-len 2048 --block-size 32 --enforce-eager --dtype float32")
    parser.add_argument("--limit-seconds", type=float, default=120)
    parser.add_argument("--out", help="JSON file for the report")
    args = parser.parse_args(argv)

    log = Path(tempfile.mkdtemp(prefix="kvserve-crash-")) / "server.log"
    engine_args = [*shlex.split(args.server_args), "--served-model-name", "crash"]
    dockerfile = Path(__file__).resolve().parents[2] / "docker" / "Dockerfile"
    with running_server_process("kvserve", args.model, engine_args, log, {"VLLM_CPU_KVCACHE_SPACE": "1"}) as (
        proc,
        base,
    ):
        check = image_healthcheck(int(base.rsplit(":", 1)[1]), dockerfile) if dockerfile.exists() else None
        report = kill_engine_and_measure(proc, base, "crash", args.in_flight, args.limit_seconds, check)
    report["server_log"] = str(log)
    print(json.dumps(report, indent=1))
    if args.out:
        report["provenance"] = provenance(command_line(argv, "kvserve bench crash"))
        Path(args.out).write_text(json.dumps(report, indent=1))
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
