"""One workload: N long prompts sent at once, streamed, timed per request; the server's gauges sampled meanwhile."""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvserve.http_client import client_limits
from kvserve.phases import PHASES
from kvserve.tools.eval.client import Setting, metric_sum, stream_chunks


@dataclass
class RequestTiming:
    ttft: float  # seconds from sending to the first streamed token
    tpot: float  # mean seconds per output token after the first
    output_tokens: int
    text: str = ""  # the completion


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    setting: Setting,
    on_first_token: Callable[[], None] | None = None,
    salt: str = "",
) -> RequestTiming:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        # each setting on its own prefix-cache salt: settings run one after another on one server with the same
        # prompts, and a later setting must not be served from an earlier one's cached blocks (a cold start each)
        "cache_salt": f"bench:{setting.label}:{setting.budget}:{salt}",
    }
    start = time.perf_counter()
    first = None
    output_tokens = 0
    text = []
    async for chunk in stream_chunks(client, url, "/v1/completions", body, setting):
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            text.append(chunk["choices"][0]["text"])
            if first is None:
                first = time.perf_counter()
                if on_first_token is not None:
                    on_first_token()
        if chunk.get("usage"):
            output_tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = end if first is None else first
    return RequestTiming(
        ttft=first - start,
        tpot=(end - first) / max(output_tokens - 1, 1),
        output_tokens=output_tokens,
        text="".join(text),
    )


# Every first token scrapes at once (below), so the period only bounds how stale the peak may get between
# admissions. 0.1 s cost kvserve's API server (its multiprocess collector reads every process's files) more than
# vanilla's, on a rank's core when two ranks fill a 2-core machine (py-spy, docs/benchmarks.md): a bench artefact.
SCRAPE_EVERY_S = 0.5


class RunningPeak:
    """The most requests vLLM's running gauge showed: scraped every `SCRAPE_EVERY_S`, and once more the moment any
    request streams its first token. vLLM sets the gauge from a step's scheduler stats before it yields that step's
    tokens, so a scrape sent right after a first token reads a step with that request running. Periodic scrapes alone
    missed every running step of a sub-second workload on a busy machine (peak 0); a first-token scrape queued behind
    a periodic one still in flight missed a 4-token request that had finished by then (CI), so each first token sends
    its own scrape instead of waking the periodic one."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client, self.url, self.peak = client, url, 0.0
        self._stop = asyncio.Event()
        self._scrapes: list[asyncio.Task] = []

    async def scrape(self) -> None:
        text = (await self.client.get(self.url + "/metrics")).text
        self.peak = max(self.peak, metric_sum(text, "vllm:num_requests_running"))

    def on_first_token(self) -> None:
        self._scrapes.append(asyncio.create_task(self.scrape()))

    async def periodic(self) -> None:
        while not self._stop.is_set():
            await self.scrape()
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=SCRAPE_EVERY_S)
            except TimeoutError:
                pass

    async def finish(self, periodic: asyncio.Task) -> float:
        self._stop.set()
        await asyncio.gather(periodic, *self._scrapes)
        return self.peak


async def _run(
    url: str, model: str, prompts: list[list[int]], max_tokens: int, setting: Setting, salt: str = ""
) -> dict:
    async with httpx.AsyncClient(timeout=3600, limits=client_limits()) as client:
        before = (await client.get(url + "/metrics")).text
        running = RunningPeak(client, url)
        periodic = asyncio.create_task(running.periodic())
        start = time.perf_counter()
        timings = await asyncio.gather(
            *(_one(client, url, model, p, max_tokens, setting, running.on_first_token, salt) for p in prompts)
        )
        wall = time.perf_counter() - start
        peak = await running.finish(periodic)
        after = (await client.get(url + "/metrics")).text
    return summarize(timings, wall, peak, before, after)


def run_workload(
    url: str,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    setting: Setting,
    salt: str = "",
    keep_texts: bool = False,
) -> dict:
    """The prompts sent at once with `setting`; `salt` is added to the setting's prefix-cache salt. `keep_texts`:
    the summary also holds each completion (`texts`, in prompt order)."""
    summary = asyncio.run(_run(url, model, prompts, max_tokens, setting, salt))
    if not keep_texts:
        del summary["texts"]
    return summary


def _percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarize(
    timings: list[RequestTiming], wall: float, peak_running: float, metrics_before: str, metrics_after: str
) -> dict:
    ttft = [t.ttft for t in timings]
    tpot = [t.tpot for t in timings]
    output_tokens = sum(t.output_tokens for t in timings)

    def delta(name: str) -> float:
        return metric_sum(metrics_after, name) - metric_sum(metrics_before, name)

    return {
        "texts": [t.text for t in timings],
        "requests": len(timings),
        "wall_s": wall,
        "peak_running": peak_running,
        "requests_per_s": len(timings) / wall,
        "output_tokens_per_s": output_tokens / wall,
        "ttft_p50": _percentile(ttft, 50),
        "ttft_p90": _percentile(ttft, 90),
        "tpot_p50": _percentile(tpot, 50),
        "tpot_p90": _percentile(tpot, 90),
        "preemptions": delta("vllm:num_preemptions_total"),
        "blocks_freed": delta("kvserve:blocks_freed_total"),
        "compactions": delta("kvserve:compaction_seconds_count"),
        "compaction_seconds": delta("kvserve:compaction_seconds_sum"),
        "compaction_histogram": compaction_histogram(metrics_before, metrics_after),
        "phase_seconds": {phase: phase_delta(metrics_before, metrics_after, phase) for phase in PHASES},
    }


def phase_delta(before: str, after: str, phase: str) -> float:
    """Seconds `kvserve:engine_seconds_total{phase=...}` grew between two scrapes (0 for vanilla)."""

    def value(text: str) -> float:
        found = re.findall(rf'^kvserve:engine_seconds_total\{{[^}}]*phase="{phase}"[^}}]*\}} (\S+)$', text, re.M)
        return sum(float(v) for v in found)

    return value(after) - value(before)


def compaction_histogram(before: str, after: str) -> dict[str, float]:
    """Per-bucket counts (not cumulative) of `kvserve:compaction_seconds` added between two scrapes."""

    def buckets(text: str) -> dict[str, float]:
        counts: dict[str, float] = {}
        for bound, value in re.findall(
            r'^kvserve:compaction_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', text, re.M
        ):
            counts[bound] = counts.get(bound, 0.0) + float(value)
        return counts

    start, end = buckets(before), buckets(after)
    cumulative = {bound: end[bound] - start.get(bound, 0.0) for bound in end}
    ordered = sorted(cumulative, key=lambda b: float("inf") if b == "+Inf" else float(b))
    previous, per_bucket = 0.0, {}
    for bound in ordered:
        per_bucket[bound] = cumulative[bound] - previous
        previous = cumulative[bound]
    return per_bucket


def prompts(count: int, tokens: int, model: str) -> list[list[int]]:
    """`count` haystack prompts of `tokens` tokens each (seeded: the same prompts for every server of a run)."""
    from transformers import AutoTokenizer

    from kvserve.tools.eval.haystack import haystack

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [haystack(tokenizer, tokens, seed=1000 + number) for number in range(count)]
