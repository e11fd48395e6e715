"""N `kvserve serve` servers behind vLLM's router (`vllm-router`, the package of that name), one router policy at a
time: what `kvserve bench sessions --replicas N` measures. Each server gets a CPU of its own (vLLM's worker binding)
and publishes its KV-cache events on a ZMQ port of its own, which kv_aware routing subscribes to."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from kvserve.tools.bench.chat import SERVED_NAME
from kvserve.tools.bench.servers import free_port, healthy, running_server, server_process, wait_until_serving

ROUTER_POLICIES = ("round_robin", "consistent_hash", "cache_aware", "kv_aware")


@dataclass(frozen=True)
class Routed:
    url: str  # the router's
    replicas: dict[str, str]  # name -> a server's URL


@dataclass(frozen=True)
class Replica:
    url: str
    events: str  # its KV-cache events' ZMQ endpoint, as a subscriber connects to it


def router_binary() -> str:
    found = shutil.which("vllm-router", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise SystemExit("kvserve bench sessions --replicas needs vLLM's router: pip install vllm-router")
    return found


def router_command(binary: str, policy: str, port: int, replicas: list[Replica], block_size: int) -> list[str]:
    command = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    command += ["--worker-urls", *(replica.url for replica in replicas)]
    command += ["--worker-startup-check-interval", "1", "--log-level", "warning"]
    command += ["--prometheus-port", str(free_port())]  # its metrics exporter's, 29000 by default: one per router
    if policy == "kv_aware":
        for replica in replicas:
            command += ["--kv-event-source", f"{replica.url}={replica.events}"]
        command += ["--kv-event-block-size", str(block_size), "--kv-event-model", SERVED_NAME]
    return command


def routed_runs(args, engine_args: list[str], log_dir: Path) -> Iterator[tuple[str, Routed]]:
    """Starts `args.replicas` servers (one after another: start-ups side by side slow each other), then for each of
    `args.router_policies` a router over them; yields (policy, where to send and what to scrape) while it runs."""
    policies = [policy for policy in args.router_policies.split(",") if policy]
    unknown = sorted(set(policies) - set(ROUTER_POLICIES))
    if unknown:
        raise SystemExit(f"--router-policies: unknown {unknown} (of {', '.join(ROUTER_POLICIES)})")
    binary = router_binary()
    cpus = sorted(os.sched_getaffinity(0))
    with ExitStack() as stack:
        replicas = []
        for index in range(args.replicas):
            port = free_port()
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[index % len(cpus)])}
            server_args = [*engine_args, "--kv-events-config", json.dumps(events)]
            log = log_dir / f"replica-{index}.log"
            url = stack.enter_context(running_server("kvserve", args.model, server_args, log, env=env))
            replicas.append(Replica(url, f"tcp://127.0.0.1:{port}"))
        named = {str(index): replica.url for index, replica in enumerate(replicas)}
        for policy in policies:
            port = free_port()
            command = router_command(binary, policy, port, replicas, args.block_size)
            log = log_dir / f"router-{policy}.log"
            with server_process(command, dict(os.environ), log) as proc:
                url = f"http://127.0.0.1:{port}"
                wait_until_serving(proc, log, lambda url=url: healthy(url), 600, "vllm-router")
                yield policy, Routed(url, named)
