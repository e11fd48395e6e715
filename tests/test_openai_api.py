"""The OpenAI surface through the official `openai` client, against the real `kvserve serve`, with and without
eviction settings (headers or `vllm_xargs`)."""

from __future__ import annotations

import httpx
import openai
import pytest
from engine_settings import SERVED_MODEL

MODEL = SERVED_MODEL
EVICT = {"x-kv-policy": "snapkv", "x-kv-budget": "64"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def vanilla_text(client, long_prompt):
    """The same prompt under `full`: what every eviction run is compared with for shape, not content."""
    return (
        client.completions.create(
            model=MODEL, prompt=long_prompt, max_tokens=8, temperature=0, extra_headers={"x-kv-policy": "full"}
        )
        .choices[0]
        .text
    )


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server + "/health", timeout=120).status_code == 200
    assert "vllm:num_requests_running" in httpx.get(server + "/metrics", timeout=120).text


@pytest.mark.parametrize("how", ["headers", "vllm_xargs", "none"])
def test_completions(client, long_prompt, vanilla_text, how):
    kwargs = {
        "headers": dict(extra_headers=EVICT),
        "vllm_xargs": dict(extra_body={"vllm_xargs": {"kv_policy": "snapkv", "kv_budget": 64}}),
        "none": dict(extra_headers={"x-kv-policy": "full"}),
    }[how]
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=long_prompt, max_tokens=8, temperature=0, **kwargs
    )
    completion = raw.parse()
    assert completion.usage.completion_tokens == 8 or completion.choices[0].finish_reason == "stop"
    assert raw.headers["x-kv-policy-applied"] == ("full" if how == "none" else "snapkv")
    if how == "none":
        assert completion.choices[0].text == vanilla_text
    else:
        assert raw.headers["x-kv-budget-applied"] == "64"


def test_streamed_completion_equals_the_unstreamed_one(client, long_prompt):
    whole = (
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=12, temperature=0, extra_headers=EVICT)
        .choices[0]
        .text
    )
    stream = client.completions.create(
        model=MODEL, prompt=long_prompt, max_tokens=12, temperature=0, stream=True, extra_headers=EVICT
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == whole


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions(client, long_prompt, stream):
    messages = [{"role": "user", "content": long_prompt + "\nSummarise the text above in one sentence."}]
    kwargs = dict(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"vllm_xargs": {"kv_policy": "h2o", "kv_budget": 64}},
    )
    if stream:
        text = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(stream=True, **kwargs)
            if chunk.choices
        )
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert text


def test_invalid_setting_is_an_openai_bad_request(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_headers={"x-kv-policy": "snapkv", "x-kv-budget": "lots"}
        )
    assert error.value.body["param"] == "kv_budget"
