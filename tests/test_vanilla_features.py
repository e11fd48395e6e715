"""What vanilla vLLM serves, an evicting request serves alike: prompt logprobs (computed in the prefill, before any
compaction, so equal to vanilla's), sampled logprobs, a JSON-schema answer, and `n` choices that each evict and give
their blocks back. Vanilla's side comes from the no-plugin subprocess (tests/vanilla_run.py); both engines run float32
with the same settings (tests/engine_settings.py)."""

from __future__ import annotations

import json

import pytest
from engine_settings import (
    ANSWER_SCHEMA,
    EQUIVALENCE_MAX_TOKENS,
    FEATURE_MAX_TOKENS,
    NUM_BLOCKS,
    equivalence_prompts,
    json_prompt,
)

from kvserve.tools.eval.haystack import haystack

EVICTING = {"kv_policy": "snapkv", "kv_budget": 64}


def sampling(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(**kwargs)


def run(engine, ids: list[int], params):
    from vllm.inputs import TokensPrompt

    (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return out


def as_floats(entries) -> list[dict[str, float] | None]:
    return [None if entry is None else {str(t): lp.logprob for t, lp in entry.items()} for entry in entries]


def assert_same_logprobs(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs)
    for position, (mine, vanilla) in enumerate(zip(ours, theirs, strict=True)):
        if vanilla is None:
            assert mine is None, position
            continue
        assert mine.keys() == vanilla.keys(), position  # the same tokens: the prompt's and the top one
        assert list(mine.values()) == pytest.approx(list(vanilla.values()), abs=1e-4), position


def test_an_evicting_requests_prompt_logprobs_are_vanillas(engine, vanilla_outputs):
    """Prompt logprobs come from the prefill's logits, before the compaction where the prompt ends: an evicting
    request's equal vanilla's at every position, and so does the first sampled token's; the request did evict."""
    prompt = equivalence_prompts(engine.tokenizer)[0]
    params = sampling(
        temperature=0,
        max_tokens=FEATURE_MAX_TOKENS,
        prompt_logprobs=1,
        logprobs=1,
        ignore_eos=True,
        extra_args=EVICTING,
    )
    out = run(engine, prompt, params)
    assert out.kv_transfer_params["kv_tokens_evicted"] > 0
    assert_same_logprobs(as_floats(out.prompt_logprobs), vanilla_outputs["prompt_logprobs"])
    # after the compaction the logits are the evicted cache's: only the first token's (the prefill's) equal vanilla's
    assert_same_logprobs(as_floats(out.outputs[0].logprobs[:1]), vanilla_outputs["logprobs"][:1])


@pytest.mark.parametrize("kv", [EVICTING, {"kv_policy": "snapkv", "kv_budget": 2048}], ids=["B=64", "B-above"])
def test_a_json_schema_answer_under_eviction_parses_and_matches_the_schema(engine, vanilla_outputs, kv):
    """vLLM's structured outputs constrain an evicting request's answer as they do vanilla's: it parses and has the
    schema's keys and types; with nothing to evict the answer is vanilla's, token for token."""
    from vllm.sampling_params import StructuredOutputsParams

    params = sampling(
        temperature=0,
        max_tokens=EQUIVALENCE_MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json=ANSWER_SCHEMA),
        extra_args=kv,
    )
    out = run(engine, json_prompt(engine.tokenizer), params)
    evicted = out.kv_transfer_params["kv_tokens_evicted"]
    assert (evicted > 0) == (kv["kv_budget"] < len(out.prompt_token_ids))
    for tokens in (list(out.outputs[0].token_ids), vanilla_outputs["structured"]):
        answer = json.loads(engine.tokenizer.decode(tokens, skip_special_tokens=True))
        assert set(answer) == set(ANSWER_SCHEMA["required"])
        assert isinstance(answer["topic"], str) and isinstance(answer["pages"], int)
    if not evicted:
        assert list(out.outputs[0].token_ids) == vanilla_outputs["structured"]


def test_n_choices_each_evict_by_the_requests_policy_and_return_their_blocks(engine):
    """`n` > 1: vLLM fans the request out into one engine request per choice; each evicts on its own, as much as
    the same request with n=1 does (offline, vLLM's merged output keeps the last choice's count; over HTTP usage sums
    them: tests/test_server.py), and once all finish the pool is whole."""
    ids = haystack(engine.tokenizer, 400, seed=21)
    free_before = engine.free_blocks()
    params = sampling(n=3, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, extra_args=EVICTING)
    out = run(engine, ids, params)
    assert len(out.outputs) == 3 and all(len(choice.token_ids) == 12 for choice in out.outputs)
    one = run(engine, ids, sampling(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, extra_args=EVICTING))
    # (the worker learns a request finished with the next step's scheduler output: the n=1 run's steps end them all)
    choices = [
        state
        for key, state in engine.finished_states.items()
        if key.endswith(f"_{out.request_id}") or f"_{out.request_id}-" in key
    ]
    single = engine.eviction_state(one.request_id)
    assert len(choices) == 3 and all(state.compactions == single.compactions >= 1 for state in choices)
    assert out.kv_transfer_params["kv_tokens_evicted"] == one.kv_transfer_params["kv_tokens_evicted"] > 0
    assert engine.free_blocks() == free_before <= NUM_BLOCKS
