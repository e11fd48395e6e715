"""vLLM's `--api-key` guards kvserve's header handling too: authentication runs before any `x-kv-*` header or body
is read, so an unauthenticated client learns nothing from kvserve's validation (401, never 400), while `/health`
and `/metrics` stay open as in vanilla vLLM."""

from __future__ import annotations

import httpx
import pytest

KEY = "kvserve-test-key"
GOOD = {"x-kv-policy": "streamingllm", "x-kv-budget": "64"}
BAD = {"x-kv-policy": "streamingllm", "x-kv-budget": "lots"}


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    from kvserve.model import ensure_default_model
    from kvserve.tools.bench.servers import running_server

    args = [
        "--max-model-len",
        "512",
        "--block-size",
        "32",
        "--enforce-eager",
        "--served-model-name",
        "smollm",
        "--api-key",
        KEY,
    ]
    log_path = tmp_path_factory.mktemp("guarded") / "server.log"
    with running_server(
        "kvserve", str(ensure_default_model()), args, log_path, env={"VLLM_CPU_KVCACHE_SPACE": "1"}
    ) as base:
        yield base


def post(base: str, path: str, headers: dict, key: str | None, text: str = "Hello"):
    if key is not None:
        headers = {**headers, "authorization": f"Bearer {key}"}
    body = {"model": "smollm", "max_tokens": 2, "temperature": 0}
    body.update({"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]})
    return httpx.post(base + path, json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("key", [None, "wrong-key"])
@pytest.mark.parametrize("kv_headers", [GOOD, BAD], ids=["valid", "invalid"])
def test_without_the_key_every_generation_request_is_401(guarded_server, path, key, kv_headers):
    response = post(guarded_server, path, kv_headers, key)
    assert response.status_code == 401, response.text
    assert "x-kv-policy-applied" not in response.headers  # kvserve never saw it


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_with_the_key_kvserve_validates_and_serves(guarded_server, path, long_prompt):
    """This server runs vLLM's default dtype (bf16 on CPU), so eviction also works on the layout chosen for it."""
    rejected = post(guarded_server, path, BAD, KEY)
    assert rejected.status_code == 400 and rejected.json()["error"]["param"] == "kv_budget"
    served = post(guarded_server, path, GOOD, KEY, long_prompt)
    assert served.status_code == 200, served.text
    assert served.headers["x-kv-policy-applied"] == "streamingllm"
    usage = served.json()["usage"]
    assert usage["kv_tokens_evicted"] == usage["prompt_tokens"] - 64  # the prompt was compacted to the budget


def test_health_and_metrics_stay_open_models_do_not(guarded_server):
    assert httpx.get(guarded_server + "/health", timeout=120).status_code == 200
    assert "vllm:num_requests_running" in httpx.get(guarded_server + "/metrics", timeout=120).text
    assert httpx.get(guarded_server + "/v1/models", timeout=120).status_code == 401
    authorized = {"authorization": f"Bearer {KEY}"}
    assert httpx.get(guarded_server + "/v1/models", headers=authorized, timeout=120).status_code == 200


def test_every_policy_in_one_batch_on_the_bf16_layout(guarded_server, long_prompt):
    """bf16 is served with vLLM's AMX kernel on a CPU with AMX tiles (whose blocks kvserve stages to read and
    compact) and the vec kernel elsewhere. Every policy at once (Attention-Gate's ragged compaction too), so each
    step mixes requests that read their cache with requests that only record window queries: all served, each
    budgeted prompt compacted to the budget, and the pool full afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from kvserve.policies import POLICIES

    budget = 64
    # (kvzip serves only a compressed document's requests: tests/test_documents.py)
    names = [name for name, cls in POLICIES.items() if not cls.ragged and not cls.reconstructs] + ["attention_gate"]
    budgets = {
        name: max(budget, POLICIES[name]().protected_tokens() + 16) for name in names if name != "attention_gate"
    }
    headers = {"authorization": f"Bearer {KEY}"}

    def complete(name: str) -> httpx.Response:
        body = {
            "model": "smollm",
            "prompt": long_prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "kv_policy": name,
            "kv_budget": budgets.get(name, budget),
        }
        return httpx.post(guarded_server + "/v1/completions", json=body, headers=headers, timeout=300)

    with ThreadPoolExecutor(len(names)) as pool:
        responses = list(pool.map(complete, names))
    for name, response in zip(names, responses, strict=True):
        assert response.status_code == 200, (name, response.text)
        choice, usage = response.json()["choices"][0], response.json()["usage"]
        assert choice["finish_reason"] == "length", name
        if POLICIES[name].own_counts:  # DuoAttention's heads keep their roles' counts (test_engine.py)
            assert 0 < usage["kv_tokens_evicted"] < usage["prompt_tokens"], name
        elif name != "attention_gate":  # the gate decides its own count (test_attention_gate_engine.py)
            assert usage["kv_tokens_evicted"] == usage["prompt_tokens"] - budgets[name], name
    metrics = httpx.get(guarded_server + "/metrics", timeout=120).text
    usage_line = next(line for line in metrics.splitlines() if line.startswith("vllm:kv_cache_usage_perc"))
    assert float(usage_line.split()[-1]) == 0.0
