"""The real HTTP server (`kvserve serve`), real requests, real Prometheus text."""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest
from engine_settings import SERVED_MODEL

from kvserve.metrics import DEPRECATED_METRICS
from kvserve.model import ensure_default_model


def metric(base: str, name: str, labels: str = "", missing: float | None = None) -> float:
    """A sample's value from /metrics; a series that does not exist (yet) is an error unless `missing` is given."""
    text = httpx.get(base + "/metrics", timeout=120).text
    pattern = rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$"
    found = re.findall(pattern, text, flags=re.M)
    if not found:
        if missing is None:
            raise AssertionError(f"{name}{labels} not in /metrics")
        return missing
    return float(found[0])


def samples(text: str, name: str) -> dict[str, float]:
    """Each sample of `name` in a /metrics text: its labels -> its value."""
    return {
        labels: float(value) for labels, value in re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    }


ENGINE_0 = '{engine="0"}'  # kvserve's series carry vLLM's engine label (one engine here)
KEPT_HEADS = r'^kvserve:kept_entries_total\{allocation="heads",engine="0",layer="(\d+)"\} ([0-9.e+]+)$'


def complete(base: str, prompt: str, headers: dict | None = None, **body):
    payload = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(base + "/v1/completions", json=payload, headers=headers or {}, timeout=120)


def test_headers_select_the_policy_and_metrics_count_what_was_evicted(server, long_prompt):
    labels = '{engine="0",policy="streamingllm"}'
    evicted_before = metric(server, "kvserve:tokens_evicted_total", labels, missing=0.0)
    runs_before = metric(server, "kvserve:evictions_total", labels, missing=0.0)
    timed_before = metric(server, "kvserve:compaction_seconds_count", labels, missing=0.0)
    bytes_before = metric(server, "kvserve:kv_cache_freed_bytes_total", labels, missing=0.0)
    blocks_before = metric(server, "kvserve:blocks_freed_total", labels, missing=0.0)
    ratio_sum_before = metric(server, "kvserve:kept_token_ratio_sum", labels, missing=0.0)
    seconds_before = metric(server, "kvserve:compaction_seconds_sum", labels, missing=0.0)
    response = complete(server, long_prompt, {"x-kv-policy": "streamingllm", "x-kv-budget": "64"})
    assert response.status_code == 200, response.text
    assert response.headers["x-kv-policy-applied"] == "streamingllm"
    assert response.headers["x-kv-budget-applied"] == "64"
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    # 8 new tokens stay below budget + block size, so only the prompt was compacted: to exactly 64 entries
    assert metric(server, "kvserve:tokens_evicted_total", labels) - evicted_before == prompt_tokens - 64
    assert metric(server, "kvserve:evictions_total", labels) - runs_before == 1
    assert metric(server, "kvserve:blocks_freed_total", labels) > 0
    # the worker timed that one compaction step: the histogram gained one positive sample
    assert metric(server, "kvserve:compaction_seconds_count", labels) - timed_before == 1
    assert metric(server, "kvserve:compaction_seconds_sum", labels) > seconds_before
    # bytes = blocks x (K and V of 32 tokens, 3 KV heads x 64 dims, fp32, 30 layers), from the model's own config
    config = json.loads((ensure_default_model() / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    block_bytes = 2 * 32 * config["num_key_value_heads"] * head_dim * 4 * config["num_hidden_layers"]
    blocks = metric(server, "kvserve:blocks_freed_total", labels) - blocks_before
    assert metric(server, "kvserve:kv_cache_freed_bytes_total", labels) - bytes_before == blocks * block_bytes
    # a renamed series is still served under its deprecated name, every sample at the same value (one release)
    text = httpx.get(server + "/metrics", timeout=120).text
    for deprecated, renamed in DEPRECATED_METRICS.items():
        assert samples(text, deprecated) == samples(text, renamed) != {}
    # finished with 64 kept prompt entries + 7 computed output tokens (the 8th is sampled, never fed back)
    kept_ratio = metric(server, "kvserve:kept_token_ratio_sum", labels) - ratio_sum_before
    assert kept_ratio == pytest.approx((64 + 7) / (prompt_tokens + 7))


def test_vllm_xargs_select_the_policy(server, long_prompt):
    labels = '{engine="0",policy="snapkv"}'
    before = metric(server, "kvserve:evictions_total", labels, missing=0.0)
    response = complete(server, long_prompt, vllm_xargs={"kv_policy": "snapkv", "kv_budget": 96, "kv_window": 16})
    assert response.status_code == 200, response.text
    assert response.headers["x-kv-policy-applied"] == "snapkv"
    assert metric(server, "kvserve:evictions_total", labels) - before == 1


def test_a_kvzap_threshold_header_decides_what_each_head_keeps(server, long_prompt):
    """No entry passes a threshold above every prediction: each list keeps its window alone; every entry passes one
    below them all: each keeps the budget, as without a threshold."""
    headers = {"x-kv-policy": "kvzap", "x-kv-budget": "256", "x-kv-window": "16"}
    kept = {}
    for threshold in ("1000", "-1000", None):
        given = headers if threshold is None else {**headers, "x-kv-threshold": threshold}
        response = complete(server, long_prompt, given, max_tokens=2)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        kept[threshold] = usage["prompt_tokens"] - usage["kv_tokens_evicted"]
    assert kept == {"1000": 16, "-1000": 256, None: 256}


def test_top_level_body_keys_select_the_policy(server, long_prompt):
    """What an OpenAI client sends with extra_body={"kv_policy": ...}; vLLM itself would drop unknown keys."""
    labels = '{engine="0",policy="tova"}'
    before = metric(server, "kvserve:evictions_total", labels, missing=0.0)
    response = complete(server, long_prompt, kv_policy="tova", kv_budget=80)
    assert response.status_code == 200, response.text
    assert (response.headers["x-kv-policy-applied"], response.headers["x-kv-budget-applied"]) == ("tova", "80")
    assert response.json()["usage"]["kv_tokens_evicted"] == response.json()["usage"]["prompt_tokens"] - 80
    assert metric(server, "kvserve:evictions_total", labels) - before == 1


def test_server_default_applies_without_headers(server):
    response = complete(server, "Hello")
    assert response.status_code == 200
    assert (response.headers["x-kv-policy-applied"], response.headers["x-kv-budget-applied"]) == ("snapkv", "1024")


def test_streaming_chat_with_eviction(server, long_prompt):
    payload = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": long_prompt + " Summarise."}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        server + "/v1/chat/completions",
        json=payload,
        timeout=120,
        headers={"x-kv-policy": "snapkv", "x-kv-budget": "128"},
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-kv-policy-applied"] == "snapkv"
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 5


@pytest.mark.parametrize(
    "headers,body,field",
    [
        ({"x-kv-policy": "lru", "x-kv-budget": "64"}, {}, "kv_policy"),
        ({"x-kv-policy": "ems+caote", "x-kv-budget": "64"}, {}, "kv_policy"),  # an unsupported combination
        ({"x-kv-policy": "snapkv", "x-kv-budget": "many"}, {}, "kv_budget"),
        ({"x-kv-policy": "snapkv", "x-kv-budget": "16"}, {}, "kv_budget"),  # below the 32-token window it keeps
        ({"x-kv-policy": "snapkv", "x-kv-budget": "4096"}, {}, "kv_budget"),  # above the server's max_model_len 2048
        ({"x-kv-policy": "ems", "x-kv-budget": "64", "x-kv-tau": "1.5"}, {}, "kv_tau"),
        ({"x-kv-policy": "snapkv", "x-kv-budget": "64", "x-kv-window": "-3"}, {}, "kv_window"),
        ({"x-kv-policy": "streamingllm", "x-kv-budget": "64", "x-kv-window": "8"}, {}, "kv_window"),
        ({"x-kv-colour": "blue"}, {}, "kv_colour"),
        ({"x-kv-policy": "snapkv", "x-kv-budget": "64", "x-kv-checkpoint": "40"}, {}, "kv_checkpoint"),  # blocks
        ({"x-kv-policy": "h2o", "x-kv-budget": "64", "x-kv-checkpoint": "64"}, {}, "kv_checkpoint"),
        ({"x-kv-policy": "kvzap", "x-kv-budget": "256", "x-kv-threshold": "low"}, {}, "kv_threshold"),
        ({"x-kv-policy": "kvzap", "x-kv-budget": "64"}, {}, "kv_budget"),  # below its 128-entry window
        ({"x-kv-policy": "kvzap", "x-kv-budget": "256", "x-kv-threshold": "-4", "x-kv-span": "8"}, {}, "kv_span"),
        ({"x-kv-budget": "x" * 300}, {}, "x-kv-budget"),
        ({}, {"vllm_xargs": {"kv_policy": "snapkv", "kv_budget": "ten"}}, "kv_budget"),
        ({"x-kv-budget": "300"}, {"vllm_xargs": {"kv_policy": "snapkv", "kv_budget": 200}}, "kv_budget"),
        ({}, {"kv_budget": 300, "vllm_xargs": {"kv_policy": "snapkv", "kv_budget": 200}}, "kv_budget"),
        ({}, {"kv_policy": "snapkv", "kv_budjet": 300}, "kv_budjet"),  # a misspelt top-level key is not dropped
        ({}, {"guided_regex": "[0-9]+"}, "guided_regex"),  # removed in vLLM 0.32: would silently not constrain
        ({}, {"best_of": 3}, "best_of"),  # removed in vLLM 0.32: the answer would silently be one sample
        # breaks mid-stream in vLLM 0.32 (found by the load fuzz; vanilla vLLM too)
        ({}, {"echo": True, "logprobs": 1, "n": 2, "temperature": 1.0, "stream": True}, "echo"),
    ],
)
def test_invalid_settings_get_400_naming_the_field(server, headers, body, field):
    response = complete(server, "Hello", headers, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_duplicate_header_is_rejected(server):
    payload = b'{"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 2}'
    headers = [("content-type", "application/json"), ("x-kv-budget", "64"), ("x-kv-budget", "128")]
    response = httpx.post(server + "/v1/completions", content=payload, headers=headers, timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-kv-budget"


def test_n_choices_each_evict_and_usage_sums_them(server, long_prompt):
    """`n` > 1: vLLM serves one engine request per choice; each evicts by the request's policy on its own (the
    prompt to B: StreamingLLM keeps exactly B, and 8 new tokens stay under B + a block), and usage counts every
    choice's evicted tokens, as it counts every prompt of a list; the pool test below sees all of them returned."""
    headers = {"x-kv-policy": "streamingllm", "x-kv-budget": "64"}
    response = complete(server, long_prompt, headers, n=3, temperature=0.8, seed=3)
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"]) == 3
    assert body["usage"]["kv_tokens_evicted"] == 3 * (body["usage"]["prompt_tokens"] - 64)


def test_pool_is_full_again_after_all_requests(server):
    assert httpx.get(server + "/health", timeout=120).status_code == 200
    assert metric(server, "vllm:kv_cache_usage_perc", f'{{engine="0",model_name="{SERVED_MODEL}"}}') == 0.0
    assert metric(server, "kvserve:requests_with_evicted_cache", ENGINE_0) == 0.0


def test_server_environment_guards_memory_and_long_steps(server):
    """tcmalloc where installed, else glibc with a fixed mmap threshold: without either, glibc's heap fragments under
    scoring's growing temporaries (measured: +400 MB RSS per request)."""
    import psutil

    from kvserve.allocator import GLIBC_MMAP_THRESHOLD, find_tcmalloc

    port = server.rsplit(":", 1)[1]
    [api_server] = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "kvserve.server.launch" in " ".join(p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])
    ]
    # the engine core and worker inherit it (their /proc environ is overwritten by vLLM's process titles)
    environment = api_server.environ()
    tcmalloc = find_tcmalloc()
    if tcmalloc is not None:
        assert tcmalloc in environment.get("LD_PRELOAD", "") and "MALLOC_MMAP_THRESHOLD_" not in environment
    else:
        assert environment.get("MALLOC_MMAP_THRESHOLD_") == str(GLIBC_MMAP_THRESHOLD)
    assert int(environment.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 0)) >= 1800  # long scoring steps survive


def test_every_dashboard_query_names_a_served_series(server, long_prompt):
    """Each metric a Grafana panel queries exists on the real server's /metrics (after evicting requests)."""
    from pathlib import Path

    for headers in ({"x-kv-policy": "snapkv", "x-kv-budget": "64"}, {"x-kv-policy": "attention_gate"}):
        response = complete(server, long_prompt, headers)
        assert response.status_code == 200, response.text
    text = httpx.get(server + "/metrics", timeout=120).text
    served = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", text, re.M))
    dashboards = sorted((Path(__file__).parent.parent / "deploy" / "grafana" / "dashboards").glob("*.json"))
    assert dashboards
    queried = set()
    for path in dashboards:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                queried |= set(re.findall(r"\b((?:vllm|kvserve):[a-zA-Z0-9_:]+)", target["expr"]))
    assert {name for name in queried if name.startswith("kvserve:")}  # the dashboards do show kvserve's series
    assert queried - served == set()


def test_usage_reports_the_tokens_eviction_removed(server, long_prompt):
    """usage.kv_tokens_evicted, unstreamed and in the streamed usage chunk, equals what the engine's counter saw."""
    labels = '{engine="0",policy="streamingllm"}'
    evict = {"x-kv-policy": "streamingllm", "x-kv-budget": "64"}
    before = metric(server, "kvserve:tokens_evicted_total", labels, missing=0.0)
    usage = complete(server, long_prompt, evict).json()["usage"]
    counted = metric(server, "kvserve:tokens_evicted_total", labels) - before
    assert usage["kv_tokens_evicted"] == counted == usage["prompt_tokens"] - 64

    payload = {
        "model": SERVED_MODEL,
        "prompt": long_prompt,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server + "/v1/completions", json=payload, headers=evict, timeout=120) as response:
        chunks = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    [streamed_usage] = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    assert streamed_usage["kv_tokens_evicted"] == counted

    chat = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": long_prompt}],
        "max_tokens": 4,
        "temperature": 0,
    }
    chat_usage = httpx.post(server + "/v1/chat/completions", json=chat, headers=evict, timeout=120).json()["usage"]
    assert chat_usage["kv_tokens_evicted"] == chat_usage["prompt_tokens"] - 64

    kept_all = complete(server, long_prompt, {"x-kv-policy": "full"}).json()
    assert kept_all["usage"]["kv_tokens_evicted"] == 0 and kept_all.get("kv_transfer_params") is None

    # n choices are n engine requests, each evicting; vLLM merges their outputs, kvserve still counts each
    before = metric(server, "kvserve:tokens_evicted_total", labels)
    usage = complete(server, long_prompt, evict, n=3, temperature=1.0, seed=4).json()["usage"]
    counted = metric(server, "kvserve:tokens_evicted_total", labels) - before
    assert usage["kv_tokens_evicted"] == counted == 3 * (usage["prompt_tokens"] - 64)

    # a stop string ends the request in the front end (the engine is told to abort): the count is still there
    stopped = complete(server, long_prompt, evict, stop=[" ", "\n", "."], max_tokens=32).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] < 32
    assert stopped["usage"]["kv_tokens_evicted"] == stopped["usage"]["prompt_tokens"] - 64


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streamed_request_over_max_model_len_is_a_400_not_an_error_event(server, path):
    body = {
        "model": SERVED_MODEL,
        "max_tokens": 4,
        "stream": True,
        **({"prompt": "Hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}),
    }
    response = httpx.post(
        server + path, json=body, headers={"x-kv-policy": "snapkv", "x-kv-budget": "4096"}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "kv_budget" and "max_model_len" in response.json()["error"]["message"]


def test_allocation_and_span_headers_apply_and_the_layer_metric_shows_where_memory_went(server, long_prompt):
    """`x-kv-allocation: heads` over HTTP: applied, echoed, and the per-layer kept-entries series grew by exactly the
    L x H x B entries the prompt's compaction kept (every allocation keeps that many)."""
    text = httpx.get(f"{server}/metrics", timeout=30).text
    layers = re.findall(
        r'^kvserve:kept_entries_total\{allocation="heads",engine="0",layer="(\d+)"\} ([0-9.e+]+)$', text, re.M
    )
    before = {layer: float(value) for layer, value in layers}
    headers = {"x-kv-policy": "snapkv", "x-kv-budget": "64", "x-kv-window": "8", "x-kv-allocation": "heads"}
    response = complete(server, long_prompt, {**headers, "x-kv-span": "4"})
    assert response.status_code == 200, response.text
    assert (response.headers["x-kv-allocation-applied"], response.headers["x-kv-span-applied"]) == ("heads", "4")
    text = httpx.get(f"{server}/metrics", timeout=30).text
    after = re.findall(
        r'^kvserve:kept_entries_total\{allocation="heads",engine="0",layer="(\d+)"\} ([0-9.e+]+)$', text, re.M
    )
    kept = {layer: float(value) - before.get(layer, 0.0) for layer, value in after}
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(ensure_default_model())
    assert sorted(map(int, kept)) == list(range(model.num_hidden_layers))
    # heads keeps H x B per layer; the prompt compacted once (8 new tokens stay below the next block)
    assert set(kept.values()) == {model.num_key_value_heads * 64}
    bad = complete(server, long_prompt, {**headers, "x-kv-allocation": "layers"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_allocation"


def test_evicting_requests_read_and_publish_the_prefix_cache_and_vllm_counts_them(server):
    """A document sent twice with SnapKV (new question, a salt of its own): vLLM's prefix-cache counters count both
    requests' queries and the second's hit, and kvserve counts the blocks the first published."""
    from transformers import AutoTokenizer

    from kvserve.tools.eval.haystack import haystack

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    document = tokenizer.decode(haystack(tokenizer, 400, seed=460))
    labels = f'{{engine="0",model_name="{SERVED_MODEL}"}}'
    queries = metric(server, "vllm:prefix_cache_queries_total", labels)
    hits = metric(server, "vllm:prefix_cache_hits_total", labels)
    published = metric(server, "kvserve:prefix_blocks_published_total", ENGINE_0, missing=0.0)
    salt = uuid.uuid4().hex
    headers = {"x-kv-policy": "snapkv", "x-kv-budget": "64"}
    prompt_tokens = []
    for text in (" What is it about?", " Who wrote it?"):
        response = complete(server, document + text, headers, cache_salt=salt)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["kv_tokens_evicted"] == usage["prompt_tokens"] - 64
        prompt_tokens.append(usage["prompt_tokens"])
    assert metric(server, "vllm:prefix_cache_queries_total", labels) - queries == sum(prompt_tokens)
    # the second request read the document's blocks up to its last SnapKV window (32 queries) and a block
    assert metric(server, "vllm:prefix_cache_hits_total", labels) - hits >= prompt_tokens[0] - 32 - 2 * 32 - 16
    assert metric(server, "kvserve:prefix_blocks_published_total", ENGINE_0) - published >= prompt_tokens[0] // 32 - 1


def test_the_start_up_log_names_kvserves_version(server, tmp_path_factory):
    from kvserve import REQUIRED_VLLM_VERSION, __version__

    logs = [path.read_text() for path in tmp_path_factory.getbasetemp().glob("server*/server.log")]
    assert any(f"kvserve {__version__} (vLLM {REQUIRED_VLLM_VERSION}): serving" in log for log in logs)
