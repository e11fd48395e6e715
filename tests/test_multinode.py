"""A model split over two nodes with vLLM's own flags (`--nnodes 2 --node-rank R --master-addr ...`, node 1
`--headless`), each node a `kvserve serve` process tree of its own on one CPU of this machine, over loopback.

The head node serves evicting requests over HTTP with both nodes' ranks (what each rank keeps is compared with one
worker in tests/test_tensor_parallel.py, layout `2n`); when node 1 dies (its whole process group killed, as when
its machine goes away), the head node's next request fails instead of hanging, and the head node's server exits with
status 1 saying that a remote worker went away, so a supervisor restarts it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from waiting import wait_until

from kvserve.tools.bench.servers import free_port, running_server_process
from kvserve.tools.bench.tiny_models import tiny_model

ENGINE = ["--enforce-eager", "--max-model-len", "2048", "--block-size", "32", "--dtype", "float32"]


@pytest.fixture
def two_nodes(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two nodes on one machine need a CPU each; this process may use one")
    model = str(tiny_model("llama"))
    rendezvous = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    rendezvous += ["--master-port", str(free_port())]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(cpus[-1]))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with open(tmp_path / "node1.log", "w") as log:
        second = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "serve", model, *ENGINE, *rendezvous, "--node-rank", "1"]
            + ["--headless"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    head_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpus[0])}
    try:
        args = [*ENGINE, *rendezvous, "--node-rank", "0"]
        with running_server_process("kvserve", model, args, tmp_path / "node0.log", head_env) as (head, base):
            yield head, base, second, model, tmp_path
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()


def test_a_dead_node_ends_the_head_nodes_server_with_the_reason(two_nodes):
    head, base, second, model, logs = two_nodes
    prompt = " ".join(str(n) for n in range(1, 301)) + " What comes next?"
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    headers = {"x-kv-policy": "snapkv", "x-kv-budget": "64"}
    served = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=300)
    assert served.status_code == 200 and served.json()["usage"]["kv_tokens_evicted"] > 0
    assert served.headers["x-kv-policy-applied"] == "snapkv"

    os.killpg(second.pid, signal.SIGKILL)  # node 1 goes away: its launcher and its worker
    second.wait()
    failed = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert failed.status_code == 500
    wait_until(lambda: head.poll() is not None, 300, "the head node's server exiting after node 1 died")
    assert head.returncode == 1
    log = (logs / "node0.log").read_text(errors="replace")
    assert "This is typically caused by a remote worker" in log  # gloo: the peer closed or reset the connection


@pytest.mark.parametrize("flag", ["--distributed-executor-backend", "--data-parallel-backend"])
def test_the_ray_executor_is_refused_at_start_up_with_vllms_reason(flag):
    """vLLM's CPU platform names no Ray device, so its Ray executor cannot place a worker (vLLM's engine failed deep
    in its start-up with "current platform cpu does not support ray"); kvserve serve stops before starting it, with
    that reason and what to use instead."""
    from vllm.platforms import current_platform

    assert not current_platform.ray_device_key  # the premise: were it set, this refusal would have to go
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", str(tiny_model("llama")), *ENGINE]
        + ["--tensor-parallel-size", "2", flag, "ray", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1
    assert f"{flag} ray" in result.stderr and "current platform cpu does not support ray" in result.stderr
    assert "--headless" in result.stderr
