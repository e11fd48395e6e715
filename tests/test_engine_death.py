"""When the engine dies anyway, the server says so: /health fails, the process exits non-zero, the image's
HEALTHCHECK command fails, and in-flight requests end instead of hanging. A server of its own (this test kills it).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from kvserve.model import ensure_default_model
from kvserve.tools.bench.crash import image_healthcheck, kill_engine_and_measure
from kvserve.tools.bench.servers import running_server_process

DOCKERFILE = Path(__file__).parents[1] / "docker" / "Dockerfile"
LIMIT_S = 120


def test_a_dead_engine_fails_health_and_exits_non_zero(tmp_path):
    args = [
        "--max-model-len",
        "1024",
        "--block-size",
        "32",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--served-model-name",
        "crash",
    ]
    with running_server_process(
        "kvserve", str(ensure_default_model()), args, tmp_path / "server.log", env={"VLLM_CPU_KVCACHE_SPACE": "1"}
    ) as (proc, base):
        check = image_healthcheck(int(base.rsplit(":", 1)[1]), DOCKERFILE)
        report = kill_engine_and_measure(proc, base, "crash", in_flight=2, limit_s=LIMIT_S, healthcheck=check)
    print(json.dumps(report, indent=1))
    assert report["health_before"] == 200 and report["healthcheck_exit_before"] == 0
    assert report["health_failed_s"] is not None and report["health_failed_s"] < LIMIT_S
    assert report["healthcheck_exit_after"] != 0
    assert report["exit_code"] not in (None, 0), (tmp_path / "server.log").read_text()[-3000:]
    # in-flight streams end with vLLM's error event (or a broken connection), never as if they had completed
    assert len(report["in_flight"]) == 2 and not any(r.get("completed") for r in report["in_flight"])
    assert report["passed"]


def test_a_requested_shutdown_still_exits_zero(tmp_path):
    """SIGTERM (docker stop, systemd stop) is not a failure: the engine-death exit status must not leak into it."""
    args = ["--max-model-len", "1024", "--block-size", "32", "--enforce-eager", "--dtype", "float32"]
    with running_server_process(
        "kvserve", str(ensure_default_model()), args, tmp_path / "server.log", env={"VLLM_CPU_KVCACHE_SPACE": "1"}
    ) as (proc, _):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=LIMIT_S) == 0, (tmp_path / "server.log").read_text()[-3000:]
