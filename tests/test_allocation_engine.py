"""`kv_allocation` and `kv_span` in the real engine: the request keeps L*H*B entries in all, spread as its allocation
says; its page lists hold exactly those entries; greedy tokens equal the plain-PyTorch model
(kvserve/tools/training/llama.py, no serving code) evaluated with the same per-(layer, head) keep sets; decode
compactions return every list to its share; the pool is full again afterwards."""

from __future__ import annotations

import pytest
import torch
from engine_settings import BLOCK_SIZE

from kvserve.policies.allocation import head_floor, pyramid_budgets
from kvserve.tools.eval.haystack import haystack

BUDGET, WINDOW, PROMPT = 64, 8, 300
SNAPKV = {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_window": WINDOW}
# every allocation at spans of single tokens, and spans of 8 under two of them
SETTINGS = [("uniform", 8), ("heads", 1), ("heads", 8), ("global", 1), ("pyramid", 1)]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def plain_model():
    from kvserve.model import ensure_default_model
    from kvserve.tools.training.llama import PlainLlama

    return PlainLlama(ensure_default_model())


def kept_sets(state) -> list[list[set[int]]]:
    """Per layer, per KV head: the kept positions."""
    return [
        [{p for p in row.tolist() if p >= 0} for row in state.layers[layer].kept_positions]
        for layer in sorted(state.layers)
    ]


@torch.no_grad()
def plain_greedy(model, prompt_ids: list[int], max_tokens: int, kept: list[list[set[int]]]) -> list[int]:
    """Greedy decoding where the prompt attends causally in full and every later query of (layer, head) sees only
    that head's kept prompt positions and the tokens generated since (what the engine holds before any decode
    compaction)."""
    tokens = list(prompt_ids)
    for _ in range(max_tokens):
        n = len(tokens)
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        visible = []
        for heads in kept:
            layer_masks = []
            for positions in heads:
                allowed = torch.ones(n, n, dtype=torch.bool)
                prompt_keys = torch.zeros(n, dtype=torch.bool)
                prompt_keys[list(positions)] = True
                allowed[len(prompt_ids) :, : len(prompt_ids)] = prompt_keys[None, : len(prompt_ids)]
                layer_masks.append(causal & allowed)
            visible.append(torch.stack(layer_masks))
        out = model.forward(torch.tensor([tokens]), visible=visible)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens[len(prompt_ids) :]


def record_reports(engine, monkeypatch) -> list:
    """The page reports the scheduler applies, in order."""
    reports = []
    original = engine.scheduler.evicting_manager.apply_report

    def apply_report(request_id, report):
        reports.append(report)
        return original(request_id, report)

    monkeypatch.setattr(engine.scheduler.evicting_manager, "apply_report", apply_report)
    return reports


@pytest.mark.parametrize("allocation,span", SETTINGS)
def test_allocation_keeps_l_h_b_in_its_pages_and_decodes_as_the_plain_model(
    engine, plain_model, monkeypatch, allocation, span
):
    ids = haystack(engine.tokenizer, PROMPT, seed=81)
    free_before = engine.free_blocks()
    reports = record_reports(engine, monkeypatch)
    max_tokens = 8  # no decode compaction (B + block size is 32 tokens away): the lists are the prompt compaction's
    out = engine.generate([ids], max_tokens, {**SNAPKV, "kv_allocation": allocation, "kv_span": span})[0]
    state = engine.eviction_state(out.request_id)
    kept = kept_sets(state)
    counts = torch.tensor([[len(head) for head in layer] for layer in kept])  # [L, H]
    layers, heads = counts.shape
    assert int(counts.sum()) == layers * heads * BUDGET
    if allocation in ("heads", "global"):
        assert int(counts.min()) >= head_floor(BUDGET, WINDOW)
        assert len(set(counts.flatten().tolist())) > 1  # the scores moved memory between heads
    if allocation == "heads":
        assert counts.sum(dim=1).tolist() == [heads * BUDGET] * layers
    if allocation == "global":
        assert len(set(counts.sum(dim=1).tolist())) > 1  # and between layers
    if allocation == "pyramid":
        per_layer = pyramid_budgets(BUDGET, layers, WINDOW + 1)
        assert counts.tolist() == [[budget] * heads for budget in per_layer]
    if allocation == "uniform":
        assert counts.tolist() == [[BUDGET] * heads] * layers
    # the pages hold exactly the kept entries: the prompt compaction's report
    (report,) = reports
    assert report.stages[0].entries == int(counts.sum())
    assert report.stages[0].pages == sum(cdiv(int(c), BLOCK_SIZE) for c in counts.flatten())
    assert list(out.outputs[0].token_ids) == plain_greedy(plain_model, ids, max_tokens, kept)
    engine.generate([[1, 2, 3]], 1)  # one more step lets the worker drop the finished request's state
    assert engine.free_blocks() == free_before


@pytest.mark.parametrize("allocation", ["heads", "global"])
def test_decode_compactions_return_each_list_to_its_share(engine, monkeypatch, allocation):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = haystack(engine.tokenizer, PROMPT, seed=82)
    free_before = engine.free_blocks()
    reports = record_reports(engine, monkeypatch)
    params = SamplingParams(
        temperature=0, max_tokens=3 * BLOCK_SIZE, ignore_eos=True, extra_args={**SNAPKV, "kv_allocation": allocation}
    )
    engine.llm.llm_engine.add_request(f"share-{allocation}", TokensPrompt(prompt_token_ids=ids), params)
    engine.llm.llm_engine.step()  # the whole prompt, then its compaction
    (state,) = [s for req_id, s in engine.runner.kvserve.requests.items() if req_id.startswith(f"share-{allocation}")]
    after_prompt = {i: (layer.kept_positions >= 0).sum(dim=1) for i, layer in state.layers.items()}
    while engine.llm.llm_engine.has_unfinished_requests():
        engine.llm.llm_engine.step()
    assert state.compactions >= 3  # the prompt's, then one per block of new tokens
    for layer_idx, counts in after_prompt.items():
        assert torch.equal((state.layers[layer_idx].kept_positions >= 0).sum(dim=1), counts), layer_idx
    assert len(reports) == state.compactions and len({report.stages[0].entries for report in reports}) == 1
    engine.generate([[1, 2, 3]], 1)
    assert engine.free_blocks() == free_before
