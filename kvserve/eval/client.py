"""The HTTP side of evaluation: one OpenAI-compatible server, the eviction setting sent as kvserve's headers.

Works against vanilla vLLM too for the `full` setting: vanilla ignores the `x-kv-*` headers. (kvserve must get
`x-kv-policy: full`, or its server-wide default policy would apply.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Setting:
    """One row of a results table: a policy at a budget (`full` has none)."""

    policy: str
    budget: int | None
    evict_every_chunk: bool = False

    def headers(self) -> dict[str, str]:
        headers = {"x-kv-policy": self.policy}
        if self.budget is not None:
            headers["x-kv-budget"] = str(self.budget)
        if self.evict_every_chunk:
            headers["x-kv-evict-every-chunk"] = "true"
        return headers


def settings(policies: list[str], budgets: list[int], evict_every_chunk: bool = False) -> list[Setting]:
    """`full` once (the reference row), every other policy at every budget."""
    full = [Setting("full", None)] if "full" in policies else []
    return full + [Setting(p, b, evict_every_chunk) for p in policies if p != "full" for b in budgets]


def metric_sum(text: str, name: str) -> float:
    """Sum of a series' samples over all label sets in Prometheus text (0 when the series is absent)."""
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+|NaN)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M) if v != "NaN")


class Server:
    def __init__(self, url: str, model: str | None = None, timeout: float = 900) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout)
        self.model = model or self.http.get(self.url + "/v1/models").json()["data"][0]["id"]

    def metrics_text(self) -> str:
        return self.http.get(self.url + "/metrics").text

    def blocks_freed(self) -> float:
        return metric_sum(self.metrics_text(), "kvserve:blocks_freed_total")

    def complete(self, setting: Setting, prompt: str | list[int], **body) -> dict:
        response = self.http.post(self.url + "/v1/completions", headers=setting.headers(), json={
            "model": self.model, "prompt": prompt, "temperature": 0, **body})
        if response.status_code != 200:
            raise RuntimeError(f"{self.url} answered {response.status_code}: {response.text[:500]}")
        return response.json()


def load_rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def append_row(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
