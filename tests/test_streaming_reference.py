"""kvserve/tools/eval/streaming.py: the transformers loop that reads a prompt in chunks, compacting after each one."""

from __future__ import annotations

import pytest
import torch

from kvserve.tools.bench.tiny_models import tiny_model
from kvserve.tools.eval import streaming

PROMPT_TOKENS = 200
CHUNK = 48


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, streaming.QueryCapture(model), AutoTokenizer.from_pretrained(folder)


def prompt_ids(count: int) -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(100, 5000, (count,), generator=generator).tolist()


@pytest.mark.parametrize("rule", ["full", "keydiff", "mix"])
def test_chunks_that_evict_nothing_decode_what_generate_does(tiny, rule):
    """A budget above the prompt: the chunked loop (its masks, positions and decoding) must give transformers' own
    greedy tokens, whatever the rule."""
    model, capture, tokenizer = tiny
    ids = prompt_ids(PROMPT_TOKENS)
    streamed = streaming.stream(model, capture, ids, rule, 10**6, CHUNK, 8, 8, tokenizer)
    with torch.no_grad():
        reference = model.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    assert streamed.answer == tokenizer.decode(reference[0, PROMPT_TOKENS:])


@pytest.mark.parametrize("rule", ["keydiff", "snapkv", "lookahead", "mix"])
def test_every_chunk_leaves_each_head_the_budget_and_the_newest_window(tiny, rule):
    model, capture, tokenizer = tiny
    budget = 40
    streamed = streaming.stream(model, capture, prompt_ids(PROMPT_TOKENS), rule, budget, CHUNK, 8, 4, tokenizer)
    newest = set(range(PROMPT_TOKENS - streaming.WINDOW, PROMPT_TOKENS))
    for positions in streamed.kept_positions:
        assert positions.shape[1] == budget
        for head in positions:
            assert head.tolist() == sorted(set(head.tolist()))  # ascending, each once
            assert newest <= set(head.tolist())


def test_mix_keeps_each_rules_best_entries(tiny):
    """`mix` ranks an entry by its better percentile under lookahead and keydiff: whatever both rules put first
    survives, so with a budget of the protected window plus one, mix keeps an entry that one of them keeps."""
    model, capture, tokenizer = tiny
    budget, chunk = streaming.WINDOW + 8, streaming.WINDOW  # the first chunk fits: one compaction, after the second
    kept = {
        rule: streaming.stream(model, capture, prompt_ids(chunk * 2), rule, budget, chunk, 8, 1, tokenizer)
        for rule in ("keydiff", "lookahead", "mix")
    }
    for layer, mixed in enumerate(kept["mix"].kept_positions):
        for head in range(mixed.shape[0]):
            union = set(kept["keydiff"].kept_positions[layer][head].tolist())
            union |= set(kept["lookahead"].kept_positions[layer][head].tolist())
            assert set(mixed[head].tolist()) <= union
    # ... and it is neither rule alone: somewhere it takes what only the other one keeps
    for rule in ("keydiff", "lookahead"):
        assert any(
            not torch.equal(mixed, alone)
            for mixed, alone in zip(kept["mix"].kept_positions, kept[rule].kept_positions, strict=True)
        )


def test_an_unknown_scorer_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match="--scorers"):
        streaming.main(["--model", "unused", "--scorers", "keydiff,nonsense"])
