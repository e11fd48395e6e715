"""SnapKV ("SnapKV: LLM Knows What You are Looking for Before Generation", Li et al. 2024, arXiv:2404.14469)
against a dense reference written from its definition (avg and max pooling), also on a compacted cache whose
sparse positions decide causality."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from references import window_observation

from kvserve.policies import LayerObservation, SnapKV


def dense_snapkv(obs: LayerObservation, budget: int, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """SnapKV from its definition: full softmax rows of the window queries, causal by position, summed."""
    heads, n, dim = obs.keys.shape
    keep = []
    for h in range(heads):
        group = obs.window_queries.shape[1] // heads
        votes = torch.zeros(n)
        for g in range(group):
            for i in range(obs.window_queries.shape[0]):
                q = obs.window_queries[i, h * group + g]
                logits = (obs.keys[h] @ q) * obs.scale
                logits[obs.positions[h] > obs.window_positions[i]] = float("-inf")
                votes += torch.softmax(logits, dim=0)
        prefix = votes[: n - window][None, None]
        pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
        pooled = pool(prefix, kernel, stride=1, padding=kernel // 2)[0, 0]
        top = torch.sort(pooled, descending=True, stable=True).indices[: budget - window]  # ties: earlier token
        keep.append(sorted(top.tolist() + list(range(n - window, n))))
    return torch.tensor(keep)


@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize("n,budget", [(64, 24), (200, 100), (33, 32)])
def test_snapkv_matches_dense_reference(pooling, n, budget):
    window, kernel = 8, 5
    obs = window_observation(n, window=window, seed=n)
    keep = SnapKV(window=window, kernel_size=kernel, pooling=pooling).keep_indices(obs, budget)
    assert torch.equal(keep, dense_snapkv(obs, budget, window, kernel, pooling))


def test_snapkv_after_compaction_uses_positions_for_causality():
    # a cache that was compacted before: positions are sparse; window queries are the newest tokens
    positions = torch.stack([torch.sort(torch.randperm(300)[:80]).values for _ in range(3)])
    positions[:, -8:] = torch.arange(292, 300)
    obs = window_observation(80, window=8, positions=positions, seed=3)
    keep = SnapKV(window=8, kernel_size=3).keep_indices(obs, 40)
    assert torch.equal(keep, dense_snapkv(obs, 40, 8, 3, "avg"))
