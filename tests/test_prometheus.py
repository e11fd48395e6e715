"""A real Prometheus (Debian's `prometheus`) scrapes the real server with deploy/prometheus/prometheus.yml, and every
query of every Grafana dashboard in deploy/grafana/ parses and returns data through Prometheus's HTTP API after a
short mixed workload. (Grafana itself is not installable on these machines; its queries are what it would send.)"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from engine_settings import SERVED_MODEL
from waiting import wait_until

from kvserve.tools.bench.servers import free_port

DEPLOY = Path(__file__).parent.parent / "deploy"
SCRAPE_SECONDS = 1
# Grafana's built-in interval variables, as Grafana would expand them at this scrape interval
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every dashboard."""
    queries = []
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for variable, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(variable, value)
                assert "$" not in expr, f"{path.name}: {panel['title']}: unexpanded variable in {expr}"
                queries.append((panel["title"], expr))
    return queries


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "Prometheus is not installed (Debian: apt-get install prometheus): the dashboards' queries were "
            "not run through it"
        )
    folder = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_SECONDS}s", evaluation_interval=f"{SCRAPE_SECONDS}s")
    for job in config["scrape_configs"]:  # the shipped file names the compose service; point it at this server
        for static in job["static_configs"]:
            static["targets"] = [urlparse(server).netloc]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{free_port()}"
    log = open(folder / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address={base[7:]}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: _ready(base), 60, "Prometheus ready (its log: " + str(folder / "prometheus.log") + ")")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _ready(base: str) -> bool:
    try:
        return httpx.get(base + "/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(base: str, expr: str) -> dict:
    body = httpx.get(base + "/api/v1/query", params={"query": expr}, timeout=30).json()
    assert body["status"] == "success", f"{expr}: {body.get('error')}"
    return body["data"]


def _values(data: dict) -> list[float]:
    if data["resultType"] == "scalar":
        return [float(data["result"][1])]
    return [float(sample["value"][1]) for sample in data["result"]]


def mixed_workload(server: str, long_prompt: str) -> None:
    """Evicting and plain requests, completions and chat, streamed and not, and a request the server refuses."""

    def post(path: str, body: dict, headers: dict | None = None) -> httpx.Response:
        return httpx.post(
            server + path,
            json={"model": SERVED_MODEL, "max_tokens": 8, "temperature": 0, **body},
            headers=headers or {},
            timeout=300,
        )

    for headers in (
        {"x-kv-policy": "snapkv", "x-kv-budget": "64"},
        {"x-kv-policy": "h2o", "x-kv-budget": "96"},
        {"x-kv-policy": "attention_gate"},
        {"x-kv-policy": "full"},
    ):
        assert post("/v1/completions", {"prompt": long_prompt}, headers).status_code == 200
    chat = {"messages": [{"role": "user", "content": long_prompt}], "stream": True}
    assert post("/v1/chat/completions", chat, {"x-kv-policy": "streamingllm", "x-kv-budget": "64"}).status_code == 200
    assert post("/v1/completions", {"prompt": "Hi"}, {"x-kv-budget": "-1"}).status_code == 400


def test_every_dashboard_query_returns_data_from_a_real_prometheus(server, prometheus, long_prompt):
    wait_until(lambda: _values(query(prometheus, 'up{job="kvserve"}')) == [1.0], 60, "Prometheus scraping kvserve")
    # Twice: a series a request creates is first scraped at its value after the request, and rate() counts no
    # increase from a series' first sample; the second round moves every series Prometheus already holds.
    for _ in range(2):
        mixed_workload(server, long_prompt)
        served = httpx.get(server + "/metrics", timeout=120).text
        evictions = sum(float(v) for v in re.findall(r"^kvserve:evictions_total\{[^}]*\} (\S+)$", served, re.M))
        wait_until(
            lambda want=evictions: sum(_values(query(prometheus, "kvserve:evictions_total"))) == want,
            60,
            "Prometheus scraping the workload's evictions",
        )
    queries = dashboard_queries()
    assert queries

    def lacking() -> list[str]:
        """The queries without a finite value (yet: a series' later samples land a scrape or two on, later still on
        a busy machine, so this is polled rather than read after a fixed pause)."""
        found = {(title, expr): _values(query(prometheus, expr)) for title, expr in queries}
        return [f"{title}: {expr} gave {v}" for (title, expr), v in found.items() if not any(map(math.isfinite, v))]

    wait_until(lambda: not lacking(), 60, lambda: "data from every dashboard query; none from: " + "; ".join(lacking()))
