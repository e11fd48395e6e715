"""The served `kvzap` policy (arXiv:2601.07891) on the real engine against a PyTorch reference that shares no serving
code: the default model in plain PyTorch (kvserve/tools/training/llama.py) gives each layer's queries before RoPE,
the shipped surrogate scores them, and every (layer, KV head) list must keep what those scores choose, with those
scores beside its entries: prompt chunks, decode steps, a fixed budget and a threshold. A surrogate trained for
another model is refused naming kv_policy."""

from __future__ import annotations

import json

import pytest
import torch
from engine_settings import BLOCK_SIZE

from kvserve.tools.eval.haystack import haystack

NEAR = 2e-3  # predicted log scores this close to a cut-off may fall either side of it (float noise)


@pytest.fixture(scope="module")
def reference():
    from kvserve.kvzap.registry import checked_surrogates
    from kvserve.model import ensure_default_model
    from kvserve.tools.training.llama import PlainLlama

    model_dir = ensure_default_model()
    return PlainLlama(model_dir), checked_surrogates(str(model_dir))


def reference_scores(reference, ids: list[int]) -> list[torch.Tensor]:
    """Per layer [H, n]: the surrogate over the plain model's queries before RoPE for `ids`, no eviction."""
    model, surrogates = reference
    scores = []

    def observe(layer: int, attention, values, hidden) -> None:
        x = model._rms(hidden[0], model.weights[f"layers.{layer}.input_layernorm.weight"])
        scores.append(surrogates.scores(layer, model._project(x, layer, "self_attn.q_proj")))

    with torch.no_grad():
        model.forward(torch.tensor([ids]), observe=observe)
    return scores


def expected_keep(scores: torch.Tensor, end: int, budget: int, window: int, threshold: float | None) -> set[int]:
    """One head's kept positions among 0..end-1: the window, then the best scores (with a threshold, only those at
    or above it), up to the budget."""
    recent = set(range(end - window, end))
    order = [int(i) for i in torch.argsort(scores[:end], descending=True, stable=True) if int(i) not in recent]
    if threshold is not None:
        order = [i for i in order if float(scores[i]) >= threshold]
    return recent | set(order[: budget - len(recent)])


def assert_kept(state, scores: list[torch.Tensor], end: int, budget: int, window: int, threshold=None) -> None:
    """Every list keeps what the reference chooses (but for entries within NEAR of its cut-off) and holds the
    reference's scores beside what it kept."""
    compared = 0
    for layer_idx, layer in state.layers.items():
        served = layer.stats["kvzap"]
        for head in range(layer.kept_positions.shape[0]):
            row = layer.kept_positions[head]
            count = int((row >= 0).sum())
            kept = row[:count].tolist()
            reference_row = scores[layer_idx][head]
            torch.testing.assert_close(served[head, :count], reference_row[kept], rtol=1e-3, atol=NEAR)
            expected = expected_keep(reference_row, end, budget, window, threshold)
            cut = min(float(reference_row[i]) for i in expected - set(range(end - window, end)) or kept)
            if threshold is not None:
                cut = threshold if len(expected) < budget else max(cut, threshold)
            for position in set(kept) ^ expected:
                assert abs(float(reference_row[position]) - cut) < NEAR, (layer_idx, head, position)
            compared += 1
    assert compared == 30 * 3


def test_prompt_chunks_score_their_entries_and_keep_the_best(engine, reference):
    """Two prompts side by side are prefilled in 128-token chunks: each chunk's entries are scored as written."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    budget, window = 128, 32
    prompts = [haystack(engine.tokenizer, 300, seed=s) for s in (140, 141)]
    free_before = engine.free_blocks()
    kv = {"kv_policy": "kvzap", "kv_budget": budget, "kv_window": window}
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, extra_args=kv)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    for out, ids in zip(outs, prompts, strict=True):
        state = engine.eviction_state(out.request_id)
        assert_kept(state, reference_scores(reference, ids), len(ids), budget, window)
        assert out.kv_transfer_params["kv_tokens_evicted"] == len(ids) - budget
    engine.generate([[1, 2, 3]], 1)
    assert engine.free_blocks() == free_before


def test_decode_steps_score_their_entries_and_a_decode_compaction_keeps_the_best(engine, reference, monkeypatch):
    """Two requests decode side by side: each step's new entries of both are scored in one call per layer."""
    from kvserve.worker import eviction

    batched = []
    score_together = eviction._token_scores

    def counted(plans, layer_idx, queries):
        batched.append(len(plans))
        return score_together(plans, layer_idx, queries)

    monkeypatch.setattr(eviction, "_token_scores", counted)
    budget, window = 128, 32
    prompts = [haystack(engine.tokenizer, 100, seed=seed) for seed in (142, 147)]
    outs = engine.generate(prompts, 70, {"kv_policy": "kvzap", "kv_budget": budget, "kv_window": window})
    assert 2 in batched
    for ids, out in zip(prompts, outs, strict=True):
        state = engine.eviction_state(out.request_id)
        end = budget + BLOCK_SIZE  # the one compaction: once the lists reach B + one block, in decode
        assert state.compactions == 1
        written = ids + list(out.outputs[0].token_ids)  # no eviction before that compaction: the reference is exact
        assert_kept(state, reference_scores(reference, written[:end]), end, budget, window)


def test_a_failure_scoring_requests_together_falls_back_to_each_alone(engine, monkeypatch):
    """Scoring the step's requests in one call is an optimisation: if it fails, each request scores alone (the same
    lists and tokens) and the engine serves on."""
    from kvserve.worker import eviction

    prompts = [haystack(engine.tokenizer, 100, seed=seed) for seed in (148, 149)]
    kv = {"kv_policy": "kvzap", "kv_budget": 128, "kv_window": 32}

    def kept(outs) -> list:
        return [{i: layer.kept_positions.clone() for i, layer in engine.eviction_state(out.request_id).layers.items()}
                for out in outs]  # fmt: skip

    together = engine.generate(prompts, 70, kv)
    alone_scores = eviction._token_scores

    raised = []

    def failing_together(plans, layer_idx, queries):
        if len(plans) > 1:
            raised.append(layer_idx)
            raise RuntimeError("injected")
        return alone_scores(plans, layer_idx, queries)

    monkeypatch.setattr(eviction, "_token_scores", failing_together)
    alone = engine.generate(prompts, 70, kv)
    assert raised
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in together]
    for a, b in zip(kept(alone), kept(together), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a)


def test_a_threshold_keeps_what_passes_per_list_and_frees_the_rest(engine, reference):
    budget, window = 256, 16
    ids = haystack(engine.tokenizer, 400, seed=143)
    scores = reference_scores(reference, ids)
    threshold = float(torch.cat([s.flatten() for s in scores]).median())  # about half of the older entries leave
    free_before = engine.free_blocks()
    kv = {"kv_policy": "kvzap", "kv_budget": budget, "kv_window": window, "kv_threshold": threshold}
    out = engine.generate([ids], 2, kv)[0]
    state = engine.eviction_state(out.request_id)
    assert_kept(state, scores, len(ids), budget, window, threshold)
    counts = [int((layer.kept_positions[h] >= 0).sum()) for layer in state.layers.values() for h in range(3)]
    assert len(set(counts)) > 1 and max(counts) <= budget  # each head keeps what its content needs
    for layer_idx, layer in state.layers.items():  # each list holds its kept entries and the decoded one, no more
        for head in range(3):
            assert state.pages.lens[layer_idx, head] == int((layer.kept_positions[head] >= 0).sum()) + 1
    mean_kept = sum(counts) / len(counts)
    assert out.kv_transfer_params["kv_tokens_evicted"] == len(ids) - round(mean_kept)
    engine.generate([[1, 2, 3]], 1)
    assert engine.free_blocks() == free_before


def test_a_surrogate_trained_for_another_model_is_refused_naming_the_policy(engine, monkeypatch, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from vllm.exceptions import VLLMValidationError

    from kvserve.kvzap import registry
    from kvserve.model import DEFAULT_MODEL_NAME

    shipped = registry.SHIPPED_DIR / f"{DEFAULT_MODEL_NAME}.safetensors"
    with safe_open(str(shipped), "pt") as f:
        meta = f.metadata()
    other = {**json.loads(meta["model"]), "name": "SomeFineTune", "q_proj_digest": "0" * 16}
    save_file(load_file(str(shipped)), str(tmp_path / shipped.name), metadata={**meta, "model": json.dumps(other)})
    monkeypatch.setattr(registry, "SHIPPED_DIR", tmp_path)
    registry.checked_surrogates.cache_clear()
    try:
        with pytest.raises(VLLMValidationError) as error:
            engine.generate([[1, 2, 3]], 1, {"kv_policy": "kvzap", "kv_budget": 160})
        assert "kv_policy" in str(error.value) and "SomeFineTune" in str(error.value)
        (tmp_path / shipped.name).unlink()
        registry.checked_surrogates.cache_clear()
        with pytest.raises(VLLMValidationError) as error:
            engine.generate([[1, 2, 3]], 1, {"kv_policy": "kvzap", "kv_budget": 160})
        assert "kv_policy" in str(error.value) and "no KVzap surrogate" in str(error.value)
    finally:
        registry.checked_surrogates.cache_clear()


def test_a_document_compressed_by_kvzap_is_resumed_by_its_next_question(engine):
    """kv_document: the document compacts once where it ends, keeping what kvzap keeps of the document alone (its
    scores are each token's own, so the question after it changes nothing); the next question resumes from it. With
    a threshold the lists' counts fill no whole blocks, which a published document needs: refused, naming it."""
    import uuid

    from vllm.exceptions import VLLMValidationError

    from kvserve.metrics import metrics

    document = haystack(engine.tokenizer, 300, seed=144)
    kv = {"kv_policy": "kvzap", "kv_budget": 128, "kv_window": 16}
    with pytest.raises(VLLMValidationError) as refused:
        engine.generate([document], 1, {**kv, "kv_threshold": -6.0, "kv_document": len(document)})
    assert "kv_document" in str(refused.value) and "kv_threshold" in str(refused.value)
    free = engine.free_blocks()
    alone = engine.generate([document], 1, kv, cache_salt=uuid.uuid4().hex)[0]
    wanted = {i: layer.kept_positions.clone() for i, layer in engine.eviction_state(alone.request_id).layers.items()}
    salt = uuid.uuid4().hex
    asked = engine.tokenizer.encode(" What is this text about? It is about", add_special_tokens=False)
    with_document = {**kv, "kv_document": len(document)}
    first = engine.generate([document + asked], 6, with_document, cache_salt=salt)[0]
    kept = engine.eviction_state(first.request_id).layers
    for layer_idx, positions in wanted.items():
        assert torch.equal(kept[layer_idx].kept_positions, positions), layer_idx
    hits = metrics().checkpoint_hits._value.get()
    other = engine.tokenizer.encode(" Which words does it use most? It uses", add_special_tokens=False)
    second = engine.generate([document + other], 6, with_document, cache_salt=salt)[0]
    assert second.num_cached_tokens == len(document) and metrics().checkpoint_hits._value.get() == hits + 1
    assert second.kv_transfer_params["kv_tokens_evicted"] == first.kv_transfer_params["kv_tokens_evicted"] > 0
    engine.generate([[1, 2, 3]], 1)
    assert engine.free_blocks() == free


def test_kvzap_evicts_after_every_chunk_and_gives_every_block_back(engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    free = engine.free_blocks()
    prompts = [haystack(engine.tokenizer, 600, seed=s) for s in (145, 146)]  # side by side: 128-token chunks
    for extra in ({"kv_evict_every_chunk": True}, {"kv_threshold": -6.0, "kv_evict_every_chunk": True}):
        kv = {"kv_policy": "kvzap", "kv_budget": 192, "kv_window": 32, **extra}
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, extra_args=kv)
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        for out in outs:
            state = engine.eviction_state(out.request_id)
            assert state.compactions >= 3, extra  # the prompt's chunks, then decode
            assert out.kv_transfer_params["kv_tokens_evicted"] > 0, extra
            assert int(state.pages.lens.max()) <= 192 + 64, extra
    engine.generate([[1, 2, 3]], 1)
    assert engine.free_blocks() == free


def test_kvzap_checkpoints_a_prompt_and_a_request_with_that_prefix_resumes_from_it(engine):
    """kv_checkpoint=C: the prompt compacts at every multiple of C and publishes the lists with their scores; a
    request with the same prefix and a new tail resumes from the last checkpoint, reads no plain block (its entries
    would have no scores), and keeps what the same request keeps on a miss."""
    import uuid

    from kvserve.metrics import metrics

    kv = {"kv_policy": "kvzap", "kv_budget": 128, "kv_window": 16, "kv_checkpoint": 64}
    prefix = haystack(engine.tokenizer, 320, seed=147)
    tails = [engine.tokenizer.encode(f" Question {i}: what is it about?", add_special_tokens=False) for i in (1, 2)]
    free, salt = engine.free_blocks(), uuid.uuid4().hex
    published = metrics().checkpoints_published._value.get()
    first = engine.generate([prefix + tails[0]], 4, kv, cache_salt=salt)[0]
    assert metrics().checkpoints_published._value.get() > published
    hits = metrics().checkpoint_hits._value.get()
    resumed = engine.generate([prefix + tails[1]], 4, kv, cache_salt=salt)[0]
    assert metrics().checkpoint_hits._value.get() == hits + 1 and resumed.num_cached_tokens == 320
    miss = engine.generate([prefix + tails[1]], 4, kv, cache_salt=uuid.uuid4().hex)[0]
    assert miss.num_cached_tokens == 0
    assert list(resumed.outputs[0].token_ids) == list(miss.outputs[0].token_ids)
    ours, theirs = (engine.eviction_state(o.request_id).layers for o in (resumed, miss))
    for layer_idx, layer in theirs.items():
        assert torch.equal(ours[layer_idx].kept_positions, layer.kept_positions), layer_idx
        torch.testing.assert_close(ours[layer_idx].stats["kvzap"], layer.stats["kvzap"])
    assert first.kv_transfer_params["kv_tokens_evicted"] > 0
    engine.generate([[1, 2, 3]], 1)
    assert engine.free_blocks() == free
