"""Seeded sampling survives chunked prefill (the `seeded_sample` and `seeded_bookkeeping` points of
kvserve/vllm/points.py) and is reproducible however the prompt is chunked.

vLLM 0.32 on CPU kills the engine on a request with `seed` whose prompt is prefilled in more than one chunk: it
rewinds the request's generator with a CUDA-only call. kvserve restores the generator's state instead, so the
discarded draw of a partial-prefill step leaves no trace and the text equals a one-chunk run's (and vanilla vLLM's,
which can only run the one-chunk case).
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from engine_settings import CHUNK_WHEN_SHARED, SEEDED_SAMPLING, SERVED_MODEL, seeded_prompt

from kvserve.tools.eval.haystack import haystack
from kvserve.vllm.patches import _discarded_cpu_generators


@pytest.fixture
def discarded_seeded_rows(engine, monkeypatch):
    """Counts, per sampling step, the seeded rows whose sampled token vLLM discards (so: prefilled in chunks)."""
    counts: list[int] = []
    sample = engine.runner._sample

    def counting_sample(*args, **kwargs):
        counts.append(len(_discarded_cpu_generators(engine.runner)))
        return sample(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "_sample", counting_sample)
    return counts


def _seeded_run(engine, kv: dict | None, beside: list[int] | None) -> list[int]:
    """The seeded prompt alone (one prefill chunk) or beside a greedy prompt (both chunked); its sampled tokens.

    A fresh cache salt per run: a prefix-cache hit from an earlier run would leave too few tokens to chunk."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    salt = uuid.uuid4().hex
    prompts = [TokensPrompt(prompt_token_ids=seeded_prompt(engine.tokenizer), cache_salt=salt)]
    params = [SamplingParams(**SEEDED_SAMPLING, extra_args=kv)]
    if beside is not None:
        prompts.append(TokensPrompt(prompt_token_ids=beside, cache_salt=salt))
        params.append(SamplingParams(temperature=0, max_tokens=4, extra_args=kv))
    outputs = engine.llm.generate(prompts, params, use_tqdm=False)
    return list(outputs[0].outputs[0].token_ids)


def test_seeded_one_chunk_equals_vanilla_vllm(engine, vanilla_outputs, discarded_seeded_rows):
    assert _seeded_run(engine, None, beside=None) == vanilla_outputs["seeded"]
    assert sum(discarded_seeded_rows) == 0  # alone, the 600-token prompt was one chunk


@pytest.mark.parametrize(
    "kv",
    [
        None,
        {"kv_policy": "snapkv", "kv_budget": 128},
        {"kv_policy": "h2o", "kv_budget": 128},
        {"kv_policy": "h2o", "kv_budget": 128, "kv_evict_every_chunk": True},
    ],
    ids=str,
)
def test_seed_gives_the_same_text_in_one_chunk_and_in_many(engine, discarded_seeded_rows, kv):
    assert len(seeded_prompt(engine.tokenizer)) > 2 * CHUNK_WHEN_SHARED
    free_before = engine.free_blocks()
    one_chunk = _seeded_run(engine, kv, beside=None)
    assert sum(discarded_seeded_rows) == 0
    beside = haystack(engine.tokenizer, 400, seed=12)
    chunked = _seeded_run(engine, kv, beside=beside)
    assert sum(discarded_seeded_rows) >= 2  # the seeded prompt really was prefilled in several chunks
    if not (kv or {}).get("kv_evict_every_chunk"):  # evicting after every chunk keeps other entries by design
        assert chunked == one_chunk
    assert _seeded_run(engine, kv, beside=beside) == chunked  # and again
    assert engine.free_blocks() == free_before  # every block back


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_seeded_request_on_a_chunked_server_is_reproducible(server, long_prompt, path):
    """The HTTP server prefills in 128-token chunks, so the 300-token prompt is chunked: this crashed the engine."""
    body = {"model": SERVED_MODEL, "max_tokens": 12, "seed": 1, "temperature": 0.8, "ignore_eos": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": long_prompt}]
    else:
        body["prompt"] = long_prompt
    texts = []
    for headers in (
        {"x-kv-policy": "full"},
        {"x-kv-policy": "full"},
        {"x-kv-policy": "snapkv", "x-kv-budget": "64"},
        {"x-kv-policy": "snapkv", "x-kv-budget": "64"},
    ):
        body["cache_salt"] = uuid.uuid4().hex  # no prefix-cache hit: every run is prefilled in chunks
        response = httpx.post(server + path, json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        texts.append(choice.get("text") or choice["message"]["content"])
    assert texts[0] == texts[1] and texts[2] == texts[3]
    other = httpx.post(
        server + path,
        json={**body, "seed": 2, "cache_salt": uuid.uuid4().hex},
        headers={"x-kv-policy": "full"},
        timeout=120,
    )
    assert other.status_code == 200
    choice = other.json()["choices"][0]
    assert (choice.get("text") or choice["message"]["content"]) != texts[0]  # the seed is not ignored
    assert httpx.get(server + "/health", timeout=120).status_code == 200
