"""`kvserve bench long`: long prompts streamed through a bounded cache (eviction after every prefill chunk) against
the full cache, on one kvserve server started here, one request at a time.

Every case is a task of `kvserve eval tasks` (a passkey, a multi-key lookup) at each prompt length, asked once under
`full` and once under each budget with `kv_evict_every_chunk` (each chunk attends to at most B plus itself, so the
prefill's attention grows linearly with the prompt instead of with its square). Each request records its time to
first token, its time per output token, the answer's score, and the most pages the server held while it ran
(`kvserve:kv_pages_in_use`, polled): with the request alone on the server these are its own pages, which eviction
after every chunk keeps under B + one chunk + one block entries per list. Every request has a `cache_salt` of its
own: nothing comes from the prefix cache.

    kvserve bench long --model "$(kvserve setup-model qwen2.5-coder-0.5b)" --lengths 4000,8000,16000 \\
        --budgets 1024,2048 --policy keydiff --out docs/eval/long/qwen05.json --plot docs/eval/long/qwen05.png
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from kvserve.cpu_dtype import with_default_dtype
from kvserve.provenance import command_line, provenance
from kvserve.tools.bench.servers import running_server
from kvserve.tools.eval.client import Setting, metric_sum
from kvserve.tools.eval.tasks import make_case, score

SERVED_NAME = "bench"


class PeakPages:
    """The most `kvserve:kv_pages_in_use` the server reported while this is open (polled every `every` s)."""

    def __init__(self, url: str, every: float = 0.2) -> None:
        self.url, self.every, self.peak = url, every, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                text = client.get(self.url + "/metrics").text
                self.peak = max(self.peak, metric_sum(text, "kvserve:kv_pages_in_use"))
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
    tokens = usage.get("completion_tokens", len(times))
    return {
        "answer": "".join(text),
        "ttft_s": times[0] if times else None,
        "tpot_s": (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and times else None,
        "prompt_tokens": usage.get("prompt_tokens"),
        "evicted": usage.get("kv_tokens_evicted", 0),
        "peak_pages": pages.peak,
    }


def settings(args: argparse.Namespace) -> list[Setting]:
    budgets = [int(b) for b in args.budgets.split(",")]
    return [Setting("full", None)] + [Setting(args.policy, b, evict_every_chunk=True, span=args.span) for b in budgets]


def label(row: dict) -> str:
    return "full" if row["policy"] == "full" else f"{row['policy']} B={row['budget']} every chunk"


def report(rows: list[dict], pages_per_token_list: float, chunk: int, block: int) -> str:
    """Per length and setting: TTFT and TPOT medians, TTFT against full's, the peak entries per list against B +
    chunk + block, and each task's mean score."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    header = ["length", "setting", "TTFT s", "vs full", "TPOT s", "peak entries / list", "bound", *tasks]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for length in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == length]
        full_ttft = statistics.median(r["ttft_s"] for r in at if r["policy"] == "full")
        for name in dict.fromkeys(label(r) for r in at):
            mine = [r for r in at if label(r) == name]
            ttft = statistics.median(r["ttft_s"] for r in mine)
            tpots = [r["tpot_s"] for r in mine if r["tpot_s"] is not None]
            peak = max(r["peak_pages"] for r in mine) * pages_per_token_list
            budget = mine[0]["budget"]
            bound = f"{budget + chunk + block}" if budget else "-"
            scores = [f"{statistics.mean(r['score'] for r in mine if r['task'] == t):.2f}" for t in tasks]
            tpot = f"{statistics.median(tpots):.3f}" if tpots else "-"
            cells = [f"{length:,}", name, f"{ttft:.1f}", f"{ttft / full_ttft:.2f}x", tpot, f"{peak:,.0f}", bound]
            lines.append("| " + " | ".join([*cells, *scores]) + " |")
    return "\n".join(lines)


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
    parser.add_argument("--model", required=True, help="a model folder (kvserve setup-model prints one)")
    parser.add_argument("--lengths", default="4000,8000,16000", help="prompt lengths in tokens")
    parser.add_argument("--budgets", default="1024,2048")
    parser.add_argument("--policy", default="keydiff", help="the policy that evicts after every chunk")
    parser.add_argument("--span", type=int, default=1, help="kv_span of the evicting settings")
    parser.add_argument("--tasks", default="passkey,multikey_one")
    parser.add_argument("--samples", type=int, default=2, help="cases per task and length")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (--max-num-batched-tokens)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--server-args", default="", help="more engine flags, one string")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--plot", default=None, help="PNG of TTFT against prompt length")
    args = parser.parse_args(argv)

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
        with running_server("kvserve", args.model, engine_args, log) as url, httpx.Client(timeout=3600) as client:
            for case in cases:
                for setting in settings(args):
                    row = ask(client, url, case.prompt, case.max_tokens, setting)
                    row.update(
                        task=case.task,
                        length=case.length,
                        index=case.index,
                        policy=setting.policy,
                        budget=setting.budget,
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
    if args.plot:
        plot(rows, args.plot)
    if args.out:
        recorded = {**vars(args), "model": Path(args.model).name, "layers": layers, "kv_heads": heads}
        ran = provenance(command_line(argv, "kvserve bench long"))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": recorded, "provenance": ran, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
