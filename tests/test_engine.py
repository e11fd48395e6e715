"""The real vLLM engine with kvserve, on the default model, against vanilla vLLM and plain-PyTorch references."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from engine_settings import BLOCK_SIZE, EQUIVALENCE_MAX_TOKENS, NUM_BLOCKS, equivalence_prompts, fitting_window
from hf_reference import (
    attention_probabilities,
    expected_attention_reference,
    generate_with_kept,
    snapkv_reference,
    streamingllm_generate,
    top_keep,
)

from kvserve.metrics import metrics
from kvserve.policies import POLICIES, POLICY_NAMES
from kvserve.policies.duo_attention import DuoAttention
from kvserve.policies.snapkv import SnapKV
from kvserve.tools.eval.haystack import haystack
from kvserve.vllm.carriers import plan_of

# Policies that keep exactly the budget; Attention-Gate decides its own ragged counts (test_attention_gate_engine.py),
# DuoAttention gives each head its count from its roles, so even a budget above the sequence cuts its streaming heads;
# KVzip serves only a compressed document's requests (tests/test_documents.py)
BUDGETED = [
    name
    for name in POLICY_NAMES
    if name == "full" or not (POLICIES[name].ragged or POLICIES[name].own_counts or POLICIES[name].reconstructs)
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prompt(engine, n: int, seed: int) -> list[int]:
    return haystack(engine.tokenizer, n, seed=seed)


def test_baseline_is_vanilla_vllm(vanilla_outputs):
    assert vanilla_outputs["scheduler"] == "Scheduler"  # the subprocess really ran without kvserve's plugin


@pytest.mark.parametrize(
    "kv",
    [None] + [{"kv_policy": name, "kv_budget": 2048} if name != "full" else {"kv_policy": "full"} for name in BUDGETED],
    ids=str,
)
def test_budget_above_sequence_matches_vanilla(engine, vanilla_outputs, kv):
    prompts = equivalence_prompts(engine.tokenizer)
    outputs = engine.generate(prompts, EQUIVALENCE_MAX_TOKENS, kv)
    assert [list(o.outputs[0].token_ids) for o in outputs] == vanilla_outputs["outputs"]
    if kv and kv["kv_policy"] != "full":
        assert all(engine.eviction_state(o.request_id).compactions == 0 for o in outputs)


def test_streamingllm_matches_pytorch_reference(engine, hf_model):
    ids = prompt(engine, 200, seed=3)
    budget, sinks, max_tokens = 96, 4, 120
    out = engine.generate([ids], max_tokens, {"kv_policy": "streamingllm", "kv_budget": budget})[0]
    reference = streamingllm_generate(hf_model, ids, max_tokens, budget, sinks, BLOCK_SIZE)
    # prefill compaction plus one per block of decoded tokens
    assert engine.eviction_state(out.request_id).compactions == 1 + (max_tokens - 1) // BLOCK_SIZE
    assert list(out.outputs[0].token_ids) == reference


def _assert_same_kept(engine_kept: torch.Tensor, ref_kept: torch.Tensor, ref_scores: torch.Tensor, layer: int):
    """Equal kept sets, except where the reference itself cannot tell two tokens apart (a float tie)."""
    for head in range(ref_kept.shape[0]):
        ours, theirs = set(engine_kept[head].tolist()), set(ref_kept[head].tolist())
        for a, b in zip(sorted(ours - theirs), sorted(theirs - ours), strict=True):
            gap = abs(float(ref_scores[head, a] - ref_scores[head, b]))
            assert gap <= 1e-5 * float(ref_scores[head].max()), f"layer {layer} head {head}: {a} kept, {b} dropped"


def test_snapkv_keeps_what_dense_attention_chooses(engine, hf_model):
    ids = prompt(engine, 400, seed=4)
    budget, window, kernel = 128, 32, SnapKV().kernel_size  # the class's pool: what a request naming snapkv gets
    # span 1: the per-token choice the reference makes (SnapKV's default span is 8)
    out = engine.generate([ids], 1, {"kv_policy": "snapkv", "kv_budget": budget, "kv_span": 1})[0]
    state = engine.eviction_state(out.request_id)
    ref_keep, ref_scores = snapkv_reference(hf_model, ids, budget, window, kernel)
    assert len(state.layers) == len(ref_keep) == hf_model.config.num_hidden_layers
    for layer, keep in enumerate(ref_keep):
        kept = state.layers[layer].kept_positions
        assert kept.shape == (hf_model.config.num_key_value_heads, budget)
        _assert_same_kept(kept, keep, ref_scores[layer], layer)
    # heads really choose differently (per-head eviction, not one shared choice)
    assert any(
        not torch.equal(state.layers[i].kept_positions[0], state.layers[i].kept_positions[1])
        for i in range(len(ref_keep))
    )


def test_expected_attention_keeps_what_the_models_own_query_statistics_choose(engine, hf_model):
    """The engine rebuilds the queries before RoPE by undoing the rotation with the table it read from vLLM's
    rotary module; the reference takes them from the hidden states times W_q and its RoPE from the HF model."""
    ids = prompt(engine, 400, seed=9)
    budget, window, future, sinks = 128, 48, 256, 4
    settings = {
        "kv_policy": "expected_attention",
        "kv_budget": budget,
        "kv_window": window,
        "kv_future": future,
        "kv_sink_tokens": sinks,
        "kv_span": 1,  # the per-token choice the reference makes (score-based policies default to span 8)
    }
    out = engine.generate([ids], 1, settings)[0]
    state = engine.eviction_state(out.request_id)
    ref_keep, ref_scores = expected_attention_reference(hf_model, ids, budget, window, future, sinks)
    assert len(state.layers) == len(ref_keep)
    for layer, keep in enumerate(ref_keep):
        _assert_same_kept(state.layers[layer].kept_positions, keep, ref_scores[layer], layer)


def test_duoattention_streaming_heads_keep_sinks_and_recent_and_retrieval_heads_snapkvs_choice(engine, hf_model):
    """The shipped roles of the default model at its default retrieval fraction: a streaming head keeps exactly its 16
    sinks and 64 newest tokens; a retrieval head keeps the retrieval heads' equal share of 30 x 3 x B, chosen as SnapKV
    chooses from the model's own attention; the blocks freed follow from those counts."""
    from kvserve.duo.roles import HeadRoles
    from kvserve.model import DEFAULT_MODEL_NAME

    ids = prompt(engine, 400, seed=10)
    budget, fraction = 128, DuoAttention().retrieval_fraction
    out = engine.generate([ids], 1, {"kv_policy": "duoattention", "kv_budget": budget, "kv_span": 1})[0]
    state = engine.eviction_state(out.request_id)
    roles = HeadRoles.for_model(DEFAULT_MODEL_NAME, hf_model.config.num_key_value_heads).retrieval(fraction)
    total, retrieval = roles.numel(), int(roles.sum())
    share = (total * budget - (total - retrieval) * 80) // retrieval
    ref_keep, ref_scores = snapkv_reference(hf_model, ids, share, 32, DuoAttention().kernel_size)
    streaming_keep = list(range(16)) + list(range(len(ids) - 64, len(ids)))
    for layer, (keep, scores) in enumerate(zip(ref_keep, ref_scores, strict=True)):
        kept = state.layers[layer].kept_positions
        for head in range(kept.shape[0]):
            positions = [p for p in kept[head].tolist() if p >= 0]
            if roles[layer, head]:
                assert len(positions) == share, (layer, head)
                _assert_same_kept(torch.tensor([positions]), keep[head : head + 1], scores[head : head + 1], layer)
            else:
                assert positions == streaming_keep, (layer, head)
    # decoding: once a block of new tokens arrived every list returns to its count, the streaming heads to the
    # sinks and the newest tokens
    out = engine.generate([ids], 2 * BLOCK_SIZE + 8, {"kv_policy": "duoattention", "kv_budget": budget})[0]
    state = engine.eviction_state(out.request_id)
    assert state.compactions >= 2
    for layer, layer_state in state.layers.items():
        for head, row in enumerate(layer_state.kept_positions.tolist()):
            positions = [p for p in row if p >= 0]
            if roles[layer, head]:
                assert len(positions) == share and positions[-32:] == list(range(state.since - 32, state.since))
            else:
                assert positions == list(range(16)) + list(range(state.since - 64, state.since)), (layer, head)
    # a prompt shorter than the streaming window: every head keeps all it holds until decoding passes its count
    short = engine.generate([ids[:24]], 72, {"kv_policy": "duoattention", "kv_budget": budget})[0]
    assert len(short.outputs[0].token_ids) == 72 and engine.eviction_state(short.request_id).compactions >= 2
    assert engine.free_blocks() == NUM_BLOCKS - 1  # every block back once the requests are done (one stays null)


@pytest.mark.parametrize("policy", ["tova", "h2o"])
def test_scores_from_the_attention_pass_match_dense_attention(engine, hf_model, policy):
    """TOVA ranks by the last query's attention (group mean), H2O by attention summed over every prompt query
    with 32 recent tokens protected; the references take both from the model's own eager attention."""
    ids = prompt(engine, 400, seed=8)
    budget = 128
    # span 1: the per-token choice the references make (score-based policies default to span 8)
    out = engine.generate([ids], 1, {"kv_policy": policy, "kv_budget": budget, "kv_span": 1})[0]
    state = engine.eviction_state(out.request_id)
    for layer, probs in enumerate(attention_probabilities(hf_model, ids)):
        if policy == "tova":
            scores, protected = probs[:, -1, :], 0
        else:
            scores, protected = probs.sum(dim=1), 32
        _assert_same_kept(state.layers[layer].kept_positions, top_keep(scores, budget, protected), scores, layer)


def _record_schedules(engine, monkeypatch):
    steps: list[dict[str, int]] = []
    original = engine.scheduler.schedule

    def schedule(*args, **kwargs):
        output = original(*args, **kwargs)
        steps.append(dict(output.num_scheduled_tokens))
        return output

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    return steps


def test_chunked_prefill_gives_same_kept_set_and_text(engine, hf_model, monkeypatch):
    ids = prompt(engine, 420, seed=5)
    kv = {"kv_policy": "snapkv", "kv_budget": 128}
    single = engine.generate([ids], 24, kv)[0]
    single_state = engine.eviction_state(single.request_id)
    steps = _record_schedules(engine, monkeypatch)
    # beside a second request the scheduler splits the prompt into 128-token chunks (salted: a prefix-cache hit of
    # the first run's blocks would skip them)
    chunked = engine.generate([ids, prompt(engine, 300, seed=6)], 24, kv, cache_salt="chunked")[0]
    chunks = [s[k] for s in steps for k in s if k.startswith(f"{chunked.request_id}-") and s[k] > 1]
    assert len(chunks) >= 3, chunks
    chunked_state = engine.eviction_state(chunked.request_id)
    for layer in single_state.layers:
        assert torch.equal(single_state.layers[layer].kept_positions, chunked_state.layers[layer].kept_positions)
    assert list(chunked.outputs[0].token_ids) == list(single.outputs[0].token_ids)
    # and the text is what the model produces from exactly those kept entries
    kept = [single_state.layers[i].kept_positions for i in range(len(single_state.layers))]
    assert list(single.outputs[0].token_ids) == generate_with_kept(hf_model, ids, 24, kept)


def test_blocks_freed_after_prefill_and_returned_at_finish(engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = prompt(engine, 400, seed=7)
    budget = 64
    free_before = engine.free_blocks()
    freed_before = metrics().blocks_freed.labels(policy="streamingllm")._value.get()
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, extra_args={"kv_policy": "streamingllm", "kv_budget": budget}
    )
    engine.llm.llm_engine.add_request("accounting", TokensPrompt(prompt_token_ids=ids), params)
    engine.llm.llm_engine.step()  # the whole prompt in one step, then compaction to the budget
    assert engine.free_blocks() == free_before - cdiv(budget, BLOCK_SIZE)
    freed = metrics().blocks_freed.labels(policy="streamingllm")._value.get() - freed_before
    assert freed == cdiv(len(ids), BLOCK_SIZE) - cdiv(budget, BLOCK_SIZE)
    while engine.llm.llm_engine.has_unfinished_requests():
        engine.llm.llm_engine.step()
    assert engine.free_blocks() == free_before


def test_abort_mid_stream_returns_every_block(engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    free_before = engine.free_blocks()
    llm_engine = engine.llm.llm_engine
    for i, kv in enumerate(
        [{"kv_policy": "snapkv", "kv_budget": 96}, {"kv_policy": "streamingllm", "kv_budget": 64}, None]
    ):
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, extra_args=kv)
        llm_engine.add_request(f"abort-{i}", TokensPrompt(prompt_token_ids=prompt(engine, 300, seed=10 + i)), params)
    for _ in range(40):  # past prefill compaction and one decode compaction
        llm_engine.step()
    assert engine.free_blocks() < free_before
    llm_engine.abort_request([f"abort-{i}" for i in range(3)])
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
    llm_engine.step()
    assert engine.free_blocks() == free_before


def test_preempted_requests_return_every_block(engine):
    free_before = engine.free_blocks()
    preemptions_before = engine.scheduler.num_preemptions
    prompts = [prompt(engine, 1180, seed=20 + i) for i in range(3)]
    # the three fit once the evicting one has compacted (37 + 37 + ~5 of 80 blocks), but the two full-cache requests
    # each need a 38th block within 12 tokens and a 39th within 44: one of them must be preempted
    kv_per_request = [{"kv_policy": "streamingllm", "kv_budget": 128}, None, None]
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, extra_args=kv) for kv in kv_per_request]
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 64 for o in outputs)
    assert engine.scheduler.num_preemptions > preemptions_before
    assert engine.free_blocks() == free_before


def test_eviction_raises_concurrency_in_a_small_pool(engine):
    prompts = [prompt(engine, 600, seed=30 + i) for i in range(6)]  # 19 blocks each; 6 need 114 > 80
    peaks, preemptions = {}, {}
    for label, kv in [("full", None), ("streamingllm@128", {"kv_policy": "streamingllm", "kv_budget": 128})]:
        engine.scheduler.peak_decoding = 0
        before = engine.scheduler.num_preemptions
        engine.generate(prompts, 32, kv)
        peaks[label] = engine.scheduler.peak_decoding
        preemptions[label] = engine.scheduler.num_preemptions - before
    print(
        f"\npool {NUM_BLOCKS} blocks of {BLOCK_SIZE}: peak requests decoding together {peaks}, "
        f"preemptions {preemptions}"
    )
    assert peaks["full"] <= NUM_BLOCKS // cdiv(600 + 32, BLOCK_SIZE)  # what fits without eviction
    assert peaks["streamingllm@128"] == len(prompts)
    assert preemptions["streamingllm@128"] <= preemptions["full"]


def test_evict_every_chunk_bounds_the_cache_during_prefill(engine, monkeypatch):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = prompt(engine, 900, seed=40)
    companion = prompt(engine, 300, seed=41)  # beside it, the prompt is prefilled in 128-token chunks
    budget = 128
    held: dict[str, list[tuple[int, int]]] = defaultdict(list)  # request id -> (blocks held, tokens) per step
    manager = engine.scheduler.evicting_manager
    original = engine.scheduler.schedule

    def schedule(*args, **kwargs):
        output = original(*args, **kwargs)
        for req_id, num_new in output.num_scheduled_tokens.items():
            held[req_id].append((len(manager.req_to_blocks.get(req_id, [])), num_new))
        return output

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    steps = {}
    for every_chunk in (True, False):
        kv = {"kv_policy": "snapkv", "kv_budget": budget, "kv_evict_every_chunk": every_chunk}
        params = [
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, extra_args=kv),
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        ]
        out = engine.llm.generate(
            [TokensPrompt(prompt_token_ids=ids), TokensPrompt(prompt_token_ids=companion)], params, use_tqdm=False
        )[0]
        steps[every_chunk] = next(v for rid, v in held.items() if rid.startswith(f"{out.request_id}-"))
    # evicting after every chunk, the cache never holds more than the budget plus the chunk being computed
    assert len(steps[True]) >= 3
    assert all(blocks <= cdiv(budget + num_new, BLOCK_SIZE) for blocks, num_new in steps[True])
    assert max(blocks for blocks, _ in steps[False]) >= cdiv(len(ids), BLOCK_SIZE)


def test_invalid_settings_rejected_before_the_engine(engine):
    from vllm.exceptions import VLLMValidationError  # what vLLM raises for its own invalid parameters

    with pytest.raises(VLLMValidationError, match="kv_budget"):
        engine.generate([[1, 2, 3]], 4, {"kv_policy": "snapkv", "kv_budget": "lots"})
    with pytest.raises(VLLMValidationError, match="kv_policy"):
        engine.generate([[1, 2, 3]], 4, {"kv_policy": "nope", "kv_budget": 64})
    assert engine.generate([[1, 2, 3]], 4)[0].outputs[0].token_ids  # the engine still serves


def test_the_engine_serves_the_settings_validation_wrote_not_what_a_request_brings(engine):
    """The engine core reads a request's settings only where vLLM's input validation wrote them (`SETTINGS_KEY`):
    settings a request brings under that key itself are overwritten by what its own `kv_*` keys validate to."""
    from kvserve.config import SETTINGS_KEY, parse_kv_config

    ids = prompt(engine, 300, seed=12)
    kv = {"kv_policy": "snapkv", "kv_budget": 64}
    forged = parse_kv_config(kv, defaults={}).to_wire()
    evicting = engine.generate([ids], 2, kv)[0]
    assert evicting.kv_transfer_params["kv_tokens_evicted"] > 0
    plain = engine.generate([ids], 2, {SETTINGS_KEY: forged})[0]
    assert plain.kv_transfer_params["kv_tokens_evicted"] == 0
    broken = engine.generate([ids], 2, {SETTINGS_KEY: {"policy": "snapkv", "budget": -1}})[0]  # nor a broken one
    assert broken.kv_transfer_params["kv_tokens_evicted"] == 0 and broken.outputs[0].token_ids


def test_prefix_cache_serves_plain_and_evicting_requests(engine):
    ids = prompt(engine, 256, seed=60)
    engine.generate([ids], 2)
    assert engine.generate([ids], 2)[0].num_cached_tokens >= 224  # a plain request reuses the cached prefix
    kv = {"kv_policy": "streamingllm", "kv_budget": 64}
    assert engine.generate([ids], 2, kv)[0].num_cached_tokens >= 224  # so does an evicting one...
    other = prompt(engine, 256, seed=61)
    engine.generate([other], 2, kv)
    assert engine.generate([other], 2)[0].num_cached_tokens >= 224  # ...and its prompt blocks serve later requests
    # (tests/test_prefix_cache.py checks that a hit changes nothing an evicting request computes)


def test_every_policy_evicts_within_budget_and_returns_its_blocks(engine, monkeypatch):
    """All policies in one batch (mixed with each other in every step): prefill and decode compactions."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    budget, max_tokens = 96, 80  # decode reaches budget + block size after 32 tokens: at least one decode compaction
    names = [name for name in BUDGETED if name != "full"]
    free_before = engine.free_blocks()
    manager = engine.scheduler.evicting_manager
    original = engine.scheduler.update_from_output
    over_budget = []

    def update_from_output(scheduler_output, model_runner_output):
        result = original(scheduler_output, model_runner_output)
        for req_id in plan_of(scheduler_output).compactions:
            if len(manager.req_to_blocks.get(req_id, [])) > cdiv(budget, BLOCK_SIZE):
                over_budget.append(req_id)
        return result

    monkeypatch.setattr(engine.scheduler, "update_from_output", update_from_output)
    prompts = [TokensPrompt(prompt_token_ids=prompt(engine, 300, seed=70 + i)) for i in range(len(names))]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args=fitting_window({"kv_policy": name, "kv_budget": budget}),
        )
        for name in names
    ]
    outputs = engine.llm.generate(prompts, params, use_tqdm=False)
    assert not over_budget
    for name, out in zip(names, outputs, strict=True):
        assert len(out.outputs[0].token_ids) == max_tokens, name
        state = engine.eviction_state(out.request_id)
        assert state.config.policy == name and state.compactions >= 2, (name, state.compactions)
        for layer in state.layers.values():
            assert layer.kept_positions.shape == (engine.runner.model_config.get_total_num_kv_heads(), budget)
            assert bool((layer.kept_positions[:, 1:] > layer.kept_positions[:, :-1]).all()), name
    engine.generate([[1, 2, 3]], 1)  # one more step lets the worker drop the finished requests' state
    assert engine.free_blocks() == free_before


def test_a_raising_policy_fails_only_its_request(engine, monkeypatch):
    """A bug in a policy ends that request with finish_reason "error"; its batch neighbours and the engine go on."""
    from kvserve.policies.tova import TOVA

    def broken(self, obs):
        raise RuntimeError("injected policy failure")

    prompts = [prompt(engine, 300, seed=60 + i) for i in range(2)]
    snapkv = {"kv_policy": "snapkv", "kv_budget": 64}
    alone = engine.generate(prompts[1:], 40, snapkv)[0].outputs[0]
    free_before = engine.free_blocks()
    monkeypatch.setattr(TOVA, "score", broken)  # what a TOVA compaction asks, per token or by spans
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, extra_args=kv)
        for kv in ({"kv_policy": "tova", "kv_budget": 64}, snapkv)
    ]
    failed, neighbour = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error"
    # the output says why (the HTTP front end names the policy in its 500 only then)
    # the reason alone, "RuntimeError: injected policy failure": the front end names the policy (once) around it
    assert failed.kv_transfer_params["kv_policy_failure"] == "RuntimeError: injected policy failure"
    assert "kv_policy_failure" not in (neighbour.kv_transfer_params or {})
    assert neighbour.outputs[0].finish_reason == "length"
    assert neighbour.outputs[0].token_ids == alone.token_ids  # same as without the failing neighbour
    assert engine.free_blocks() == free_before
    monkeypatch.undo()
    again = engine.generate(prompts[:1], 8, {"kv_policy": "tova", "kv_budget": 64})[0].outputs[0]
    assert again.finish_reason == "length"  # the engine still serves, the same policy included
