"""The served `attention_gate` policy on the real engine against the offline reference: the same model and gates in
plain PyTorch (kvserve/tools/training/llama.py), which shares no serving code."""

from __future__ import annotations

import pytest
import torch
from engine_settings import BLOCK_SIZE

from kvserve.metrics import metrics
from kvserve.tools.eval.haystack import haystack

GATE = {"kv_policy": "attention_gate"}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def reference():
    from kvserve.gates.registry import load_gates
    from kvserve.model import ensure_default_model
    from kvserve.tools.training.llama import PlainLlama

    model = PlainLlama(ensure_default_model())
    s = model.shape
    gates = load_gates(str(ensure_default_model()), s.num_layers, s.num_heads * s.head_dim, s.num_kv_heads)
    return model, gates


def _served_kept(layer) -> list[set[int]]:
    """Each head's kept positions (-1 pads a head that kept fewer than the layer's longest)."""
    return [{p for p in layer.kept_positions[h].tolist() if p >= 0} for h in range(layer.kept_positions.shape[0])]


def _assert_same_kept(
    served: list[set[int]], reference_flags: torch.Tensor, probability: torch.Tensor, tau: float
) -> None:
    """Equal per head, except tokens whose reference keep probability is within 1e-4 of tau (float noise)."""
    for head, kept in enumerate(served):
        expected = set(torch.nonzero(reference_flags[:, head]).flatten().tolist())
        for position in kept ^ expected:
            assert abs(float(probability[position, head]) - tau) < 1e-4, (head, position, len(kept), len(expected))


def test_served_gate_equals_the_plain_pytorch_reference(engine, reference):
    model, gates = reference
    ids = haystack(engine.tokenizer, 160, seed=90)
    max_tokens = 6
    judged_before = metrics().gate_tokens_judged._value.get()
    kept_before = metrics().gate_tokens_kept.labels(layer="29", kv_head="0")._value.get()
    out = engine.generate([ids], max_tokens, GATE)[0]
    state = engine.eviction_state(out.request_id)
    ref_tokens, ref_flags = model.greedy(ids, max_tokens, gates)
    with torch.no_grad():
        ref_probability = model(torch.tensor([ids]), gates).keep_probability
    for layer_idx, layer in state.layers.items():
        _assert_same_kept(_served_kept(layer), ref_flags[layer_idx], ref_probability[layer_idx][0], gates.hyper.tau)
    assert list(out.outputs[0].token_ids) == ref_tokens
    # each (layer, head) list holds exactly what its gate kept, then the generated tokens: no padding
    decoded = max_tokens - 1  # the last sampled token is never written to the cache
    for layer_idx, layer in state.layers.items():
        for head, kept in enumerate(_served_kept(layer)):
            assert state.pages.lens[layer_idx, head] == len(kept) + decoded, (layer_idx, head)
    assert state.pages.pages_in_use == int(sum(cdiv(int(n), BLOCK_SIZE) for n in state.pages.lens.reshape(-1)))
    mean_kept = state.pages.lens.sum() / state.pages.lens.size - decoded
    assert out.kv_transfer_params["kv_tokens_evicted"] == len(ids) - round(mean_kept)
    assert metrics().gate_tokens_judged._value.get() - judged_before == len(ids)
    assert metrics().gate_tokens_kept.labels(layer="29", kv_head="0")._value.get() - kept_before == len(
        _served_kept(state.layers[29])[0]
    )


def test_chunked_prefill_gates_chunk_by_chunk_to_the_same_result(engine, reference):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = haystack(engine.tokenizer, 300, seed=91)
    single = engine.generate([ids], 8, GATE)[0]
    single_state = engine.eviction_state(single.request_id)
    # beside a second request the scheduler splits the prompt into 128-token chunks (engine_settings)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, extra_args=GATE)
    chunked = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=ids), TokensPrompt(prompt_token_ids=haystack(engine.tokenizer, 300, seed=92))],
        params,
        use_tqdm=False,
    )[0]
    chunked_state = engine.eviction_state(chunked.request_id)
    for layer_idx, layer in single_state.layers.items():
        assert _served_kept(layer) == _served_kept(chunked_state.layers[layer_idx])
    assert list(chunked.outputs[0].token_ids) == list(single.outputs[0].token_ids)


def test_a_long_prompt_frees_what_its_gates_evict(engine):
    """Each list keeps only its gate's tokens, so blocks go back to the pool even though some heads keep most of
    the prompt (before head pages, every head was padded to the longest list and this prompt freed nothing)."""
    ids = haystack(engine.tokenizer, 1500, seed=94)
    free_before = engine.free_blocks()
    freed_before = metrics().blocks_freed.labels(policy="attention_gate")._value.get()
    out = engine.generate([ids], 2, GATE)[0]
    state = engine.eviction_state(out.request_id)
    freed = metrics().blocks_freed.labels(policy="attention_gate")._value.get() - freed_before
    pages = int(sum(cdiv(int(n) - 1, BLOCK_SIZE) for n in state.pages.lens.reshape(-1)))  # at the compaction
    assert freed == cdiv(len(ids), BLOCK_SIZE) - cdiv(pages, state.pages.layout.pages_per_block) > 0
    assert out.kv_transfer_params["kv_tokens_evicted"] > 0
    engine.generate([[1, 2, 3]], 1)
    assert engine.free_blocks() == free_before


def test_blocks_past_the_largest_count_are_returned_and_a_budget_caps_decoding(engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    free_before = engine.free_blocks()
    manager = engine.scheduler.evicting_manager
    ids = haystack(engine.tokenizer, 400, seed=93)
    budget, max_tokens = 96, 70
    request = engine.llm.llm_engine
    request.add_request(
        "gate-blocks",
        TokensPrompt(prompt_token_ids=ids),
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args={**GATE, "kv_budget": budget}),
    )
    held_after_prefill = None
    most_blocks_in_decode = 0
    while request.has_unfinished_requests():
        request.step()
        blocks = manager.req_to_blocks.get("gate-blocks") or []
        for req_id in manager.req_to_blocks:
            if req_id.startswith("gate-blocks"):
                blocks = manager.req_to_blocks[req_id]
        if held_after_prefill is None and blocks:
            held_after_prefill = len(blocks)
        elif blocks:
            most_blocks_in_decode = max(most_blocks_in_decode, len(blocks))
    assert held_after_prefill <= cdiv(budget, BLOCK_SIZE) < cdiv(len(ids), BLOCK_SIZE)
    assert most_blocks_in_decode <= cdiv(budget + BLOCK_SIZE, BLOCK_SIZE)  # the window rule caps growth
    state = engine.eviction_state("gate-blocks")
    assert state.compactions >= 2  # the prompt, then at least once while decoding
    for layer in state.layers.values():
        assert int(layer.counts(layer.kept_positions.shape[0]).max()) <= budget
    engine.generate([[1, 2, 3]], 1)  # one more step lets the worker drop the finished request's state
    assert engine.free_blocks() == free_before


def test_a_model_without_gates_is_refused_naming_the_policy(engine, monkeypatch, tmp_path):
    from vllm.exceptions import VLLMValidationError

    registry = tmp_path / "gates.yaml"
    registry.write_text("SomeOtherModel:\n  file: other.safetensors\n  sha256: '0'\n")
    monkeypatch.setenv("KVSERVE_GATES", str(registry))
    with pytest.raises(VLLMValidationError) as error:
        engine.generate([[1, 2, 3]], 1, GATE)
    assert "kv_policy" in str(error.value) and "SomeOtherModel" in str(error.value)
