"""`kv_lookahead`: prefill chunks compacted by the votes of the question, run alone before the prompt.

The engine must keep, after every chunk, what the transformers reference (`kvserve.tools.eval.streaming`, rules
`lookahead` and `mix`) keeps when it reads the same prompt in the same chunks: the reference runs the question at its
own positions, the server runs it at 0 and rotates its queries, so agreement checks the rotation and the store too.
Over HTTP the middleware runs the question first and answers as the reference does; bad settings are 400s naming the
field; nothing is left behind (the question's queries, the probe's blocks).
"""

from __future__ import annotations

import uuid

import httpx
import pytest
import torch
from engine_settings import SERVED_MODEL
from test_engine import _record_schedules, prompt
from test_server import metric

from kvserve.config import parse_kv_config
from kvserve.errors import InvalidSetting
from kvserve.tools.eval.streaming import KERNEL, WINDOW, QueryCapture, stream
from kvserve.worker.keyed import KeyedLayers

QUESTION, BUDGET = 32, 128
RULES = {"snapkv": "lookahead", "snapkv_keydiff": "mix"}  # served policy -> the reference's rule


def probe_settings(key: str) -> dict:
    """What kvserve/server/lookahead.py sends with the question's own run."""
    return {
        "kv_policy": "snapkv",
        "kv_window": QUESTION,
        "kv_budget": QUESTION + 1,
        "kv_span": 1,
        "kv_question_probe": key,
    }


def chunk_settings(policy: str, **extra) -> dict:
    return {
        "kv_policy": policy,
        "kv_budget": BUDGET,
        "kv_span": 1,  # the per-token choice the reference makes
        "kv_kernel_size": KERNEL,
        "kv_window": WINDOW,
        "kv_evict_every_chunk": True,
        **extra,
    }


def _chunked(engine, monkeypatch, ids: list[int], kv: dict):
    """`ids` prefilled in 128-token chunks (a long-decoding companion beside it), one token generated: the output
    and the chunk sizes the scheduler cut."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    steps = _record_schedules(engine, monkeypatch)
    params = [
        SamplingParams(temperature=0, max_tokens=1, extra_args=kv),
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    ]
    salt = uuid.uuid4().hex  # no prefix-cache hit of an earlier run's blocks
    companion = TokensPrompt(prompt_token_ids=prompt(engine, 200, 61))
    prompts = [TokensPrompt(prompt_token_ids=ids, cache_salt=salt), companion]
    out = engine.llm.generate(prompts, params, use_tqdm=False)[0]
    chunks = [s[k] for s in steps for k in s if k.startswith(f"{out.request_id}-")]
    monkeypatch.undo()
    return out, chunks


def _overlap(kept: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Share of the reference's kept (layer, head, position) entries the engine kept too."""
    same = total = 0
    for ours, theirs in zip(kept, reference, strict=True):
        for head in range(theirs.shape[0]):
            same += len(set(ours[head].tolist()) & set(theirs[head].tolist()))
            total += theirs.shape[1]
    return same / total


@pytest.mark.parametrize("policy", list(RULES))
def test_chunk_compactions_keep_what_the_question_votes_for_in_the_reference(engine, hf_model, monkeypatch, policy):
    ids = prompt(engine, 560, seed=60)
    key = uuid.uuid4().hex
    store = engine.runner.kvserve.questions
    engine.generate([ids[-QUESTION:]], 1, probe_settings(key))
    assert store.get(key) is not None and len(store.get(key)) == hf_model.config.num_hidden_layers
    start = len(ids) - QUESTION
    asked, chunks = _chunked(engine, monkeypatch, ids, chunk_settings(policy, kv_question=key, kv_question_start=start))
    assert len(chunks) >= 4 and sum(chunks) == len(ids), chunks
    assert store.get(key) is None  # dropped with the request that read it
    own, own_chunks = _chunked(engine, monkeypatch, ids, chunk_settings(policy))  # its own window votes
    assert own_chunks == chunks

    capture = QueryCapture(hf_model)
    try:
        reference = stream(hf_model, capture, ids, RULES[policy], BUDGET, chunks, QUESTION, 1, engine.tokenizer)
    finally:
        capture.remove()
    layers = range(hf_model.config.num_hidden_layers)
    served = [engine.eviction_state(asked.request_id).layers[i].kept_positions for i in layers]
    unaided = [engine.eviction_state(own.request_id).layers[i].kept_positions for i in layers]
    agreement, without = _overlap(served, reference.kept_positions), _overlap(unaided, reference.kept_positions)
    print(f"\n{policy}: kept as the reference {agreement:.4f}; with its own window's votes {without:.4f}")
    assert agreement >= 0.99  # float32 both; a near-tie may fall the other way
    assert without < agreement - 0.05  # the question's votes are what made the difference
    assert list(asked.outputs[0].token_ids) == [engine.tokenizer.encode(reference.answer, add_special_tokens=False)[0]]


def test_a_request_whose_question_is_gone_fails_alone(engine):
    """Its queries were never recorded here (or a flood pushed them out): the request ends with finish_reason
    "error" and says why; the engine and its pool go on."""
    free_before = engine.free_blocks()
    kv = chunk_settings("snapkv", kv_question=uuid.uuid4().hex, kv_question_start=200)
    (failed,) = engine.generate([prompt(engine, 300, seed=63)], 4, kv)
    assert failed.outputs[0].finish_reason == "error"
    assert "question's queries are gone" in failed.kv_transfer_params["kv_policy_failure"]
    assert engine.free_blocks() == free_before
    (served,) = engine.generate([prompt(engine, 300, seed=63)], 4, chunk_settings("snapkv"))
    assert served.outputs[0].finish_reason == "length"


def test_questions_are_bounded_and_dropped():
    store = KeyedLayers(capacity=2)
    for key in "abc":
        store.recording(key)[0] = torch.zeros(1)
    assert store.get("a") is None and store.get("c") is not None and len(store) == 2
    store.drop("c")
    assert store.get("c") is None and len(store) == 1


@pytest.mark.parametrize(
    "kv, field",
    [
        ({"kv_lookahead": 32}, "kv_lookahead"),  # only the HTTP front end runs the question first
        ({"kv_question": "k", "kv_question_start": 10, "kv_evict_every_chunk": False}, "kv_question"),
        ({"kv_question": "k"}, "kv_question"),  # no start
        ({"kv_question_start": 5}, "kv_question_start"),
        ({"kv_policy": "keydiff", "kv_question": "k", "kv_question_start": 5}, "kv_question"),  # no votes
        ({"kv_policy": "keydiff", "kv_question_probe": "k"}, "kv_question_probe"),  # no window to record
    ],
)
def test_question_settings_that_cannot_hold_are_refused(kv, field):
    settings = {"kv_policy": "snapkv", "kv_budget": 128, "kv_evict_every_chunk": True, **kv}
    with pytest.raises(InvalidSetting) as refused:
        parse_kv_config(settings, defaults={})
    assert refused.value.field == field


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=300)


def test_a_lookahead_request_over_http_answers_as_the_reference(server, hf_model, tokenizer):
    """The server's chunks are 128 tokens (tests/conftest.py): the reference reads the prompt the same way."""
    ids = prompt_ids(tokenizer, 560, seed=62)
    kv = {**chunk_settings("snapkv_keydiff"), "kv_lookahead": QUESTION}
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "cache_salt": uuid.uuid4().hex, **kv}
    asked = _post(server, "/v1/completions", body)
    assert asked.status_code == 200, asked.text
    assert asked.headers["x-kv-lookahead"] == str(QUESTION)
    assert asked.headers["x-kv-policy-applied"] == "snapkv_keydiff"
    assert asked.json()["usage"]["kv_tokens_evicted"] > 0
    capture = QueryCapture(hf_model)
    try:
        reference = stream(hf_model, capture, ids, "mix", BUDGET, 128, QUESTION, 4, tokenizer)
    finally:
        capture.remove()
    assert asked.json()["choices"][0]["text"] == reference.answer

    chat = {"messages": [{"role": "user", "content": tokenizer.decode(ids)}], "max_tokens": 2, **kv}
    talked = _post(server, "/v1/chat/completions", chat)
    assert talked.status_code == 200, talked.text
    assert talked.headers["x-kv-lookahead"] == str(QUESTION)

    short = _post(server, "/v1/completions", {"prompt": "Say hello.", "max_tokens": 2, **kv})
    assert short.status_code == 200, short.text
    assert short.headers["x-kv-lookahead"] == "none"  # the prompt fits the budget: nothing to vote on
    usage = metric(server, "vllm:kv_cache_usage_perc", f'{{engine="0",model_name="{SERVED_MODEL}"}}')
    assert usage == 0.0  # the question's run gave back its blocks


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"kv_lookahead": -1}, "kv_lookahead"),
        ("/v1/completions", {"kv_lookahead": 4096}, "kv_lookahead"),
        ("/v1/completions", {"kv_lookahead": 32, "kv_evict_every_chunk": False}, "kv_lookahead"),
        ("/v1/completions", {"kv_lookahead": 32, "kv_policy": "keydiff"}, "kv_lookahead"),
        ("/v1/completions", {"kv_lookahead": 2000}, "kv_lookahead"),  # longer than the prompt
        ("/v1/completions", {"kv_lookahead": 32, "prompt": ["one " * 300, "two"]}, "prompt"),
        ("/v1/completions", {"kv_question": "mine", "kv_question_start": 3}, "kv_question"),  # kvserve's own
        (
            "/v1/chat/completions",
            {"kv_lookahead": 32, "messages": [{"role": "user", "content": "hi " * 300}], "tools": []},
            "tools",
        ),
    ],
)
def test_bad_lookahead_requests_are_400s_naming_the_field(server, path, body, field):
    kv = {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_evict_every_chunk": True}
    text = {} if path.endswith("chat/completions") else {"prompt": "word " * 300}
    refused = _post(server, path, {**text, "max_tokens": 1, **kv, **body})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == field


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvserve.model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def prompt_ids(tokenizer, n: int, seed: int) -> list[int]:
    from kvserve.tools.eval.haystack import haystack

    return haystack(tokenizer, n, seed=seed)
