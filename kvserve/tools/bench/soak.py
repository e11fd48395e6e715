"""`python -m kvserve.tools.bench soak`: does the engine's memory stay flat over many long evicting requests?

Starts `kvserve serve` once per allocator (`KVSERVE_ALLOCATOR`: tcmalloc where installed; glibc with kvserve's fixed
mmap threshold; glibc at the threshold its adaptive default climbs to), sends the same long h2o requests one after
another, and records the model worker process's resident memory (RSS; vLLM 0.32 runs it as `VLLM::Worker`, beside
`VLLM::EngineCore`) after each. A
fragmenting heap shows as RSS growing request after request; a healthy one rises during the first requests and then
stays flat.

    python -m kvserve.tools.bench soak --requests 6 --prompt-tokens 3000 --policy h2o --out soak.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from kvserve.allocator import ALLOCATOR_ENV, find_tcmalloc
from kvserve.provenance import command_line, provenance
from kvserve.tools.bench.servers import running_server_process

WORKER_PROCESS = "VLLM::Worker"
SERVED_NAME = "soak"
# glibc-32mib: the threshold glibc's adaptive default climbs to (its maximum on 64-bit), i.e. vLLM's setting after
# the first large temporaries
ALLOCATORS = {
    "tcmalloc": {ALLOCATOR_ENV: "tcmalloc"},
    "glibc-threshold": {ALLOCATOR_ENV: "glibc"},
    "glibc-32mib": {ALLOCATOR_ENV: "glibc", "MALLOC_MMAP_THRESHOLD_": str(32 << 20)},
}


def worker_process(server_pid: int) -> psutil.Process:
    """The server's model worker process (vLLM sets its title to VLLM::Worker)."""
    for child in psutil.Process(server_pid).children(recursive=True):
        if WORKER_PROCESS in child.name() or WORKER_PROCESS in " ".join(child.cmdline()):
            return child
    raise RuntimeError(f"no {WORKER_PROCESS} process under server pid {server_pid}")


def soak(allocator: str, args: argparse.Namespace, prompts: list[list[int]], log_dir: Path) -> dict:
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", **ALLOCATORS[allocator]}
    engine_args = [
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        str(args.prompt_tokens + 64),
        *shlex.split(args.server_args),
    ]
    with running_server_process("kvserve", args.model, engine_args, log_dir / f"{allocator}.log", env) as (proc, url):
        worker = worker_process(proc.pid)
        rss_mb = [worker.memory_info().rss / 2**20]
        seconds = []
        for prompt in prompts:
            start = time.perf_counter()
            response = httpx.post(
                url + "/v1/completions",
                timeout=3600,
                json={
                    "model": SERVED_NAME,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "kv_policy": args.policy,
                    "kv_budget": args.budget,
                },
            )
            response.raise_for_status()
            seconds.append(time.perf_counter() - start)
            rss_mb.append(worker.memory_info().rss / 2**20)
            print(
                f"{allocator}: request {len(seconds)}: {seconds[-1]:.1f} s, worker RSS {rss_mb[-1]:.0f} MB", flush=True
            )
    return {
        "allocator": allocator,
        "rss_mb": rss_mb,
        "seconds": seconds,
        "growth_after_first_mb": rss_mb[-1] - rss_mb[1],
    }


def main(argv: list[str] | None = None) -> None:
    from kvserve.model import default_model_dir
    from kvserve.tools.bench.workload import prompts as make_prompts

    parser = argparse.ArgumentParser(
        prog="kvserve bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument(
        "--allocators",
        default=None,
        help=f"comma list of {', '.join(ALLOCATORS)} (default: all; tcmalloc only where installed)",
    )
    parser.add_argument("--server-args", default="--block-size 128 --enforce-eager")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    names = (
        args.allocators.split(",")
        if args.allocators
        else [name for name in ALLOCATORS if name != "tcmalloc" or find_tcmalloc()]
    )
    unknown = set(names) - set(ALLOCATORS)
    if unknown:
        raise SystemExit(f"kvserve bench soak: unknown allocators {sorted(unknown)}")
    prompts = make_prompts(args.requests, args.prompt_tokens, args.model)
    with tempfile.TemporaryDirectory(prefix="kvserve-soak-") as log_dir:
        results = [soak(name, args, prompts, Path(log_dir)) for name in names]
    print(
        "\n| allocator | worker RSS MB at start, then after each request | growth after the first request MB |"
        " mean s per request |\n|---|---|---|---|"
    )
    for r in results:
        print(
            f"| {r['allocator']} | {', '.join(f'{v:.0f}' for v in r['rss_mb'])} | {r['growth_after_first_mb']:.0f}"
            f" | {sum(r['seconds']) / len(r['seconds']):.1f} |"
        )
    if args.out:
        recorded = {**vars(args), "model": Path(args.model).name}  # no machine paths in published results
        ran = provenance(command_line(argv, "kvserve bench soak"))
        Path(args.out).write_text(json.dumps({"args": recorded, "provenance": ran, "results": results}, indent=1))


if __name__ == "__main__":
    main()
