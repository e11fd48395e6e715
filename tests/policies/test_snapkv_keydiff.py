"""`snapkv_keydiff`: each entry scores its better percentile rank under SnapKV's pooled votes and under KeyDiff's
key diversity. Against the two rankings computed here from the two papers' policies: an entry is kept only if one of
them ranks it among the top of the entries left after the window, and the kept set is neither policy's alone."""

from __future__ import annotations

import pytest
import torch
from references import window_observation

from kvserve.policies import KeyDiff, SnapKV, SnapKVKeyDiff
from kvserve.policies.base import percentile_ranks


def _top(scores: torch.Tensor, count: int) -> set[int]:
    order = sorted(range(scores.shape[0]), key=lambda i: (-float(scores[i]), i))  # ties: the earlier entry
    return set(order[:count])


@pytest.mark.parametrize("n, budget, seed", [(96, 40, 0), (200, 64, 1), (64, 48, 2)])
def test_it_keeps_the_window_and_the_top_of_either_ranking(n, budget, seed):
    window = 8
    obs = window_observation(n, window=window, seed=seed)
    keep = SnapKVKeyDiff(window=window, kernel_size=5).keep_indices(obs, budget)
    votes = SnapKV(window=window, kernel_size=5).score(obs)[:, : n - window]
    diversity = KeyDiff(window=window).score(obs)[:, : n - window]
    rest = budget - window
    differs_from = set()
    for head in range(obs.num_heads):
        kept = set(keep[head].tolist())
        assert set(range(n - window, n)) <= kept and len(kept) == budget
        by_votes, by_diversity = _top(votes[head], rest), _top(diversity[head], rest)
        assert kept - set(range(n - window, n)) <= by_votes | by_diversity
        differs_from |= {"votes"} if kept != by_votes | set(range(n - window, n)) else set()
        differs_from |= {"diversity"} if kept != by_diversity | set(range(n - window, n)) else set()
    assert differs_from == {"votes", "diversity"}


def test_percentile_ranks_order_each_head_from_0_to_1():
    scores = torch.tensor([[0.1, 0.5, 0.3], [2.0, 2.0, -1.0]])
    assert percentile_ranks(scores).tolist() == [[0.0, 1.0, 0.5], [0.5, 1.0, 0.0]]  # a tie: the earlier lower
