"""Rules beside the registry-wide contract (test_contract.py): the window attention is causal by position and
normalised, and, for the policies that accept heads holding different counts (ragged), each head keeps what that
head alone would keep."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from references import (
    window_observation,
)


def test_window_attention_is_causal_and_normalised():
    obs = window_observation(50, window=6)
    probs = obs.window_attention()  # [H, G, w, n]
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[:-1]))
    assert probs[..., 0, 45:].abs().max() == 0  # the oldest window query (position 44) sees nothing after it


@pytest.mark.parametrize(
    "name,settings",
    [
        ("tova", {}),
        ("snapkv", {"kv_window": 4}),
        ("streamingllm", {}),
        ("h2o", {"kv_recent": 4}),
        ("keydiff", {"kv_window": 4}),
    ],
)
def test_ragged_heads_keep_what_each_head_alone_would_keep(name, settings):
    """Heads holding different counts (padded to the longest, `lengths` given): each head keeps exactly what the same
    policy keeps from that head's own entries alone, and a head shorter than the budget keeps all of its entries."""
    from kvserve.config import parse_kv_config

    budget, lengths = 12, torch.tensor([40, 9, 25])
    full = window_observation(40, heads=3, seed=5)
    full.stats = {"attention_sum": torch.rand(3, 40)}
    padding = torch.arange(40)[None, :] >= lengths[:, None]
    ragged = replace(
        full,
        keys=full.keys.masked_fill(padding[..., None], 0),
        values=full.values.masked_fill(padding[..., None], 0),
        positions=full.positions.masked_fill(padding, -1),
        lengths=lengths,
        stats={"attention_sum": full.stats["attention_sum"].masked_fill(padding, 0)},
    )
    policy = parse_kv_config({"kv_policy": name, "kv_budget": budget, **settings}, defaults={}).make_policy()
    selection = policy.select(ragged, budget)
    assert selection.keep_counts.tolist() == lengths.clamp(max=budget).tolist()
    for head, length in enumerate(lengths.tolist()):
        alone = replace(
            full,
            keys=full.keys[head : head + 1, :length],
            values=full.values[head : head + 1, :length],
            positions=full.positions[head : head + 1, :length],
            stats={"attention_sum": full.stats["attention_sum"][head : head + 1, :length]},
        )
        if full.window_queries is not None:  # the head's own query group
            group = full.window_queries.shape[1] // 3
            alone.window_queries = full.window_queries[:, head * group : (head + 1) * group]
        want = policy.select(alone, min(budget, length)).keep_indices[0]
        assert selection.keep_indices[head, : len(want)].tolist() == want.tolist(), head
