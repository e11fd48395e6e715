"""The load script (`kvserve bench load`): its plan offline, and a reduced run against the session's HTTP server."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from kvserve.config import parse_kv_config
from kvserve.errors import InvalidSetting
from kvserve.model import ensure_default_model
from kvserve.tools.bench import sampling_fuzz
from kvserve.tools.bench.load import POLICY_MIX, Mix, plan, render, request_body, run_load
from kvserve.tools.eval.client import metric_sum

MAX_MODEL_LEN = 2048  # the `server` fixture's
# reduced: short prompts (many still above the smaller budgets, so eviction runs; 160 tokens is more than one of the
# server's 128-token prefill chunks), a larger invalid share so every way of being invalid is sent at least once
# (an invalid request costs the server almost nothing); every valid one fuzzes sampling; 16 at a time as in the
# full run
REDUCED = Mix(
    # enough of both: each of the 29 invalid kinds is sent, and each of the 18 sampling parameters finds a valid request
    # that can take it (the dealer covers them by construction only given that many eligible requests)
    requests=72,
    invalid_share=0.45,
    abort_share=0.125,
    prompt_lengths=(24, 64, 160),
    budgets=(40, 48, 64, 96),
    max_tokens=(4, 12),
    abort_max_tokens=24,
    sampling_share=1.0,
    seed=7,
)


def _settings(case) -> dict:
    """The kv_* keys a case sends, headers and body merged (the first of a duplicated header)."""
    merged = dict(case.xargs)
    for name, value in case.headers:
        merged.setdefault("kv_" + name[len("x-kv-") :].replace("-", "_"), value)
    return merged


def test_plan_is_seeded_covers_every_policy_and_valid_means_valid():
    cases = plan(Mix(requests=300, seed=3), MAX_MODEL_LEN)
    assert [c.headers for c in cases] == [c.headers for c in plan(Mix(requests=300, seed=3), MAX_MODEL_LEN)]
    kinds = Counter(c.kind for c in cases)
    assert kinds == {"valid": 240, "abort": 30, "invalid": 30}
    assert {c.policy for c in cases if c.kind != "invalid"} == set(POLICY_MIX)
    assert all(c.stream and c.abort_after <= 3 for c in cases if c.kind == "abort")
    for case in cases:
        if case.kind == "invalid":
            continue
        config = parse_kv_config(_settings(case), defaults={})  # the server's parser accepts it
        assert config.policy == case.policy and (config.budget or 0) <= MAX_MODEL_LEN
    evicting = [c for c in cases if c.kind == "valid" and c.policy != "full"]
    assert any(c.prompt_tokens > int(_settings(c)["kv_budget"]) for c in evicting)  # eviction will run


def test_the_fuzz_covers_every_sampling_parameter_and_vllm_accepts_the_valid_draws():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    cases = plan(Mix(requests=300, seed=3), MAX_MODEL_LEN)
    carried = {name for c in cases if c.kind != "invalid" for name in c.sampling}
    broken = {c.policy for c in cases if c.kind == "invalid"}
    assert carried == set(sampling_fuzz.VALID) and set(sampling_fuzz.INVALID) <= broken
    reduced = plan(REDUCED, MAX_MODEL_LEN)
    assert {name for c in reduced if c.kind == "valid" for name in c.sampling} == set(sampling_fuzz.VALID)
    for case in cases:
        if case.kind == "invalid" or not case.sampling:
            continue
        body = request_body(case, "m", "Hello there.")
        request = (ChatCompletionRequest if case.chat else CompletionRequest)(**body)  # vLLM's own request model
        params = request.to_sampling_params(body["max_tokens"], {})
        assert params.max_tokens == case.max_tokens and params.n == body.get("n", 1)
        if case.kind == "abort":
            assert not set(case.sampling) & sampling_fuzz.SHORTENING


def test_invalid_cases_are_invalid_for_the_servers_parser():
    cases = [c for c in plan(REDUCED, MAX_MODEL_LEN) if c.kind == "invalid"]
    assert len({c.policy for c in cases}) >= 10
    for case in cases:
        settings = _settings(case)
        if case.expect_fields:  # a broken sampling parameter beside no eviction settings (the server default)
            assert not settings and list(case.sampling) == [case.policy]
            assert case.expect_param in case.expect_fields
        elif case.expect_param.startswith("x-kv-"):  # duplicate and oversized headers: the middleware's own checks
            names = [n for n, _ in case.headers]
            assert names.count(case.expect_param) > 1 or any(len(v) > 256 for _, v in case.headers)
        elif case.policy == "budget_above_max_model_len":  # vLLM's input validation knows max_model_len
            assert int(settings["kv_budget"]) > MAX_MODEL_LEN
        elif case.policy == "header_body_conflict":
            header = dict(case.headers)["x-kv-budget"]
            assert str(case.xargs["kv_budget"]) != header
        else:
            with pytest.raises(InvalidSetting) as error:
                parse_kv_config(settings, defaults={})
            assert error.value.field == case.expect_param


def test_reduced_load_leaves_the_server_healthy_with_its_pool_full(server):
    # limits only a hung server reaches: a busy machine serves this load several times slower (the settle returns as
    # soon as the server is idle, the run as soon as every request was answered)
    report = run_load(
        server, str(ensure_default_model()), REDUCED, concurrency=16, max_seconds=900, request_timeout=600, settle_s=120
    )
    print(render(report))
    cases = plan(REDUCED, MAX_MODEL_LEN)
    planned = Counter(c.kind for c in cases)
    assert not report["max_seconds_hit"] and report["sent"] == REDUCED.requests
    assert report["unexpected"] == {}
    # a client that reads slowly gets vLLM's deltas merged, so a stream may end before the client closes it: that
    # request was served in full (length checked), not aborted
    finished_first = sum(o["kind"] == "abort" and o["result"] == "ok" for o in report["outcomes"])
    assert report["ok"] == planned["valid"] + finished_first
    assert report["aborted"] == planned["abort"] - finished_first > 0
    assert report["rejected_as_expected"] == planned["invalid"] == len(report["invalid"])
    assert all(i["rejected_as_expected"] and i["detail"] == i["expected_param"] for i in report["invalid"])
    assert report["latency_s"]["all"]["n"] == report["ok"] and report["ttft_s"]["all"]["n"] > 0
    by_parameter = report["by_parameter"]
    assert all(by_parameter[name].get("ok", 0) > 0 for name in sampling_fuzz.VALID)
    assert all(set(by_parameter[name]) == {"rejected"} for name in sampling_fuzz.INVALID)
    end = report["end_state"]
    assert all(end["checks"].values()), end
    assert end["evictions"] > 0 and end["tokens_evicted"] > 0
    # and independently of the report's own scrape: healthy, pool full, nothing held
    assert httpx.get(server + "/health", timeout=120).status_code == 200
    text = httpx.get(server + "/metrics", timeout=120).text
    assert metric_sum(text, "vllm:kv_cache_usage_perc") == 0.0
    assert metric_sum(text, "kvserve:requests_with_evicted_cache") == 0.0
    assert report["passed"]
