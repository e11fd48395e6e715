"""`kvserve bench long`: long prompts streamed through a bounded cache (eviction after every prefill chunk) against
the full cache, on one kvserve server started here, one request at a time.

Every case is a task of `kvserve eval tasks` (a passkey, a multi-key lookup) at each prompt length, asked once under
`full` and once under each budget with `kv_evict_every_chunk` (each chunk attends to at most B plus itself, so the
prefill's attention grows linearly with the prompt instead of with its square). Each request records its time to
first token, its time per output token, the answer's score, and the most pages the server held while it ran
(`kvserve:kv_pages_in_use`, polled): with the request alone on the server these are its own pages, which eviction
after every chunk keeps under B + one chunk + one block entries per list. Every request has a `cache_salt` of its
own: nothing comes from the prefix cache. The worker gets every CPU of the process (`VLLM_CPU_OMP_THREADS_BIND`, unless
set): vLLM's automatic binding would keep one back.

    kvserve bench long --model "$(kvserve setup-model qwen2.5-coder-0.5b)" --lengths 4000,8000,16000 \\
        --budgets 1024,2048 --policy keydiff --out docs/eval/long/qwen05.json --plot docs/eval/long/qwen05.png
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from kvserve.cpu_dtype import with_default_dtype
from kvserve.http_client import client_limits
from kvserve.phases import INSIDE_WORKER, PHASES
from kvserve.provenance import command_line, provenance
from kvserve.tools.bench.servers import running_server
from kvserve.tools.bench.workload import phase_delta
from kvserve.tools.eval.client import Setting, metric_sum
from kvserve.tools.eval.tasks import make_case, score
from kvserve.tools.markdown import table

SERVED_NAME = "bench"


class PeakPages:
    """The most pages the server reported while this is open (polled every `every` s): `peak` in use
    (`kvserve:kv_pages_in_use`: live entries' pages), `peak_allocated` in the blocks vLLM has handed out
    (`vllm:kv_cache_usage_perc` of `kvserve:kv_pages_capacity`), which counts a chunk's blocks before it is written."""

    def __init__(self, url: str, every: float = 0.2) -> None:
        self.url, self.every, self.peak, self.peak_allocated = url, every, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=10, limits=client_limits()) as client:
            while not self._stop.is_set():
                text = client.get(self.url + "/metrics").text
                self.peak = max(self.peak, metric_sum(text, "kvserve:kv_pages_in_use"))
                allocated = metric_sum(text, "vllm:kv_cache_usage_perc") * metric_sum(text, "kvserve:kv_pages_capacity")
                self.peak_allocated = max(self.peak_allocated, allocated)
                self._stop.wait(self.every)

    def __enter__(self) -> PeakPages:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def ask(client: httpx.Client, url: str, prompt: str, max_tokens: int, setting: Setting) -> dict:
    """One streamed greedy completion: its answer, TTFT, TPOT and the peak pages held while it ran."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": uuid.uuid4().hex,
    }
    text, times, usage = [], [], {}
    before = client.get(url + "/metrics").text
    with PeakPages(url) as pages:
        start = time.perf_counter()
        with client.stream("POST", url + "/v1/completions", json=body, headers=setting.headers()) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered {response.status_code}: {response.read()[:300]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    text.append(chunk["choices"][0]["text"])
                    times.append(time.perf_counter() - start)
                usage = chunk.get("usage") or usage
    after = client.get(url + "/metrics").text
    tokens = usage.get("completion_tokens", len(times))
    return {
        "answer": "".join(text),
        "ttft_s": times[0] if times else None,
        "tpot_s": (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and times else None,
        "prompt_tokens": usage.get("prompt_tokens"),
        "evicted": usage.get("kv_tokens_evicted", 0),
        "peak_pages": pages.peak,
        "peak_allocated_pages": pages.peak_allocated,
        # where the engine's time went (the profile: kvserve/phases.py; model = worker less the rest)
        "phase_seconds": {phase: phase_delta(before, after, phase) for phase in PHASES},
    }


def settings(args: argparse.Namespace) -> list[Setting]:
    budgets = [int(b) for b in args.budgets.split(",")]
    evicting = [
        Setting(policy, budget, evict_every_chunk=True, span=args.span, lookahead=int(lookahead))
        for policy in args.policy.split(",")
        for lookahead in args.lookahead.split(",")
        for budget in budgets
    ]
    return [Setting("full", None), *evicting]


def label(row: dict) -> str:
    if row["policy"] == "full":
        return "full"
    lookahead = f", lookahead {row['lookahead']}" if row.get("lookahead") else ""
    return f"{row['policy']} B={row['budget']} every chunk{lookahead}"


def report(rows: list[dict], pages_per_token_list: float, chunk: int, block: int) -> str:
    """Per length and setting: TTFT and TPOT medians, TTFT against full's, the peak entries per list against B +
    chunk + block, and each task's mean score."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    header = ["length", "setting", "TTFT s", "vs full", "TPOT s", "peak entries / list, in use / allocated"]
    cells = []
    for length in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == length]
        full_ttft = statistics.median(r["ttft_s"] for r in at if r["policy"] == "full")
        for name in dict.fromkeys(label(r) for r in at):
            mine = [r for r in at if label(r) == name]
            ttft = statistics.median(r["ttft_s"] for r in mine)
            tpots = [r["tpot_s"] for r in mine if r["tpot_s"] is not None]
            peak = max(r["peak_pages"] for r in mine) * pages_per_token_list
            allocated = max(r.get("peak_allocated_pages", 0) for r in mine) * pages_per_token_list
            budget = mine[0]["budget"]
            bound = f"{budget + chunk + block}" if budget else "-"
            scores = [_mean_score([r for r in mine if r["task"] == task]) for task in tasks]
            tpot = f"{statistics.median(tpots):.3f}" if tpots else "-"
            held = f"{peak:,.0f} / {allocated:,.0f}"
            cells.append([f"{length:,}", name, f"{ttft:.1f}", f"{ttft / full_ttft:.2f}x", tpot, held, bound, *scores])
    return table([*header, "bound", *tasks], cells)


def _mean_score(rows: list[dict]) -> str:
    """The mean score and its count ("0.50 (2)"), or "-" where the task did not run at that length."""
    if not rows:
        return "-"
    return f"{statistics.mean(r['score'] for r in rows):.2f} ({len(rows)})"


def phase_table(rows: list[dict]) -> str:
    """At the longest length, where each setting's engine time went (medians over its cases, seconds): the model's
    own layers, attention, eviction's statistics and compaction, page bookkeeping, scheduling."""
    length = max(r["length"] for r in rows)
    at = [r for r in rows if r["length"] == length and "phase_seconds" in r]
    cells = []
    for name in dict.fromkeys(label(r) for r in at):
        phases = [r["phase_seconds"] for r in at if label(r) == name]

        def median(phase: str, phases=phases) -> float:
            return statistics.median(p[phase] for p in phases)

        model = median("worker") - sum(median(p) for p in INSIDE_WORKER)
        seconds = [median("worker"), model, *(median(p) for p in INSIDE_WORKER), median("schedule")]
        cells.append([name, *(f"{value:.1f}" for value in seconds)])
    return table(["setting", "worker", "model", *INSIDE_WORKER, "schedule"], cells)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(label(r) for r in rows):
        lengths = sorted({r["length"] for r in rows if label(r) == name})
        medians = [
            statistics.median(r["ttft_s"] for r in rows if label(r) == name and r["length"] == n) for n in lengths
        ]
        ax.plot(lengths, medians, marker="o", label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s")
    ax.set_title("Prefill time against prompt length")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def model_shape(model: str) -> tuple[int, int]:
    """(layers, KV heads) from the model folder's config.json."""
    config = json.loads((Path(model) / "config.json").read_text())
    return config["num_hidden_layers"], config.get("num_key_value_heads", config["num_attention_heads"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench long", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", required=True, help="a model folder (kvserve setup-model prints one), or tiny:ARCH (tests)"
    )
    parser.add_argument("--lengths", default="4000,8000,16000", help="prompt lengths in tokens")
    parser.add_argument("--budgets", default="1024,2048")
    parser.add_argument("--policy", default="keydiff", help="the policy (or a comma list) that evicts every chunk")
    parser.add_argument("--span", type=int, default=1, help="kv_span of the evicting settings")
    parser.add_argument(
        "--lookahead", default="0", help="kv_lookahead of the evicting settings (a comma list; 0: the chunk's votes)"
    )
    parser.add_argument("--tasks", default="passkey,multikey_one")
    parser.add_argument("--samples", type=int, default=2, help="cases per task and length")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (--max-num-batched-tokens)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--kv-space-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE of the server")
    parser.add_argument("--server-args", default="", help="more engine flags, one string")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--plot", default=None, help="PNG of TTFT against prompt length")
    args = parser.parse_args(argv)
    if args.model.startswith("tiny:"):
        from kvserve.tools.bench.tiny_models import tiny_model

        args.model = str(tiny_model(args.model.removeprefix("tiny:")))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    cases = [
        make_case(tokenizer, task, length, index)
        for length in lengths
        for task in args.tasks.split(",")
        for index in range(args.samples)
    ]
    engine_args = [
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        str(max(lengths) + 256),
        "--block-size",
        str(args.block_size),
        "--max-num-batched-tokens",
        str(args.chunk),
        "--kv-policy",
        "full",
        "--kv-profile",
        "none",
        *shlex.split(args.server_args),
    ]
    engine_args = with_default_dtype(engine_args, "bench")
    layers, heads = model_shape(args.model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-long-") as log_dir:
        log = Path(log_dir) / "kvserve.log"
        # every CPU for the one worker: vLLM's automatic binding keeps one CPU back for the server's other
        # processes, which a single request at a time does not need (on 2 cores, half the prefill's speed)
        cpus = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))
        env = {
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpus),
            "VLLM_CPU_KVCACHE_SPACE": args.kv_space_gib,
        }
        with (
            running_server("kvserve", args.model, engine_args, log, env) as url,
            httpx.Client(timeout=3600, limits=client_limits()) as client,
        ):
            for case in cases:
                for setting in settings(args):
                    row = ask(client, url, case.prompt, case.max_tokens, setting)
                    row.update(
                        task=case.task,
                        length=case.length,
                        index=case.index,
                        policy=setting.policy,
                        budget=setting.budget,
                        lookahead=setting.lookahead,
                        score=score(row["answer"], case.references),
                    )
                    rows.append(row)
                    print(
                        f"{case.task} {case.length} #{case.index} {label(row)}: ttft={row['ttft_s']:.1f}s "
                        f"tpot={row['tpot_s'] or 0:.3f}s pages={row['peak_pages']:.0f} score={row['score']:.2f}",
                        flush=True,
                    )
    print()
    print(report(rows, args.block_size / (layers * heads), args.chunk, args.block_size))
    print()
    print(phase_table(rows))
    if args.plot:
        plot(rows, args.plot)
    if args.out:
        recorded = {**vars(args), "model": Path(args.model).name, "layers": layers, "kv_heads": heads}
        ran = provenance(command_line(argv, "kvserve bench long"))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": recorded, "provenance": ran, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
