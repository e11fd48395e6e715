"""KeyDiff ("KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained
Environments", Park et al. 2025, arXiv:2504.15364) against its score written from the paper with plain loops in
float64: s_i = -cos(k_i, a), a = the mean of the cached keys' unit vectors, per KV head."""

from __future__ import annotations

import math

import pytest
import torch
from references import F64, dense_positions, generator, observation, sparse_positions

from kvserve.policies import KeyDiff


def dense_keydiff(keys: torch.Tensor, budget: int, window: int) -> list[list[int]]:
    heads, n, dim = keys.shape
    keep = []
    for h in range(heads):
        units = [keys[h, i].to(F64) / keys[h, i].to(F64).norm() for i in range(n)]
        anchor = sum(units) / n
        scores = [-(float(units[i] @ anchor) / float(anchor.norm())) for i in range(n)]
        protected = list(range(n - window, n))
        # ties go to the earlier token, as everywhere in kvserve
        ranked = sorted((i for i in range(n) if i not in protected), key=lambda i: (-scores[i], i))
        keep.append(sorted(protected + ranked[: budget - window]))
    return keep


@pytest.mark.parametrize("n,budget,window", [(64, 24, 8), (200, 100, 0), (33, 32, 4)])
def test_keydiff_matches_the_papers_score(n, budget, window):
    gen = generator(n)
    keys = torch.randn(3, n, 16, generator=gen)
    obs = observation(keys, torch.randn(3, n, 16, generator=gen), dense_positions(3, n))
    keep = KeyDiff(window=window).keep_indices(obs, budget)
    assert keep.tolist() == dense_keydiff(keys, budget, window)


def test_keydiff_keeps_the_distinct_keys_whatever_the_queries_and_positions():
    # 30 keys along one direction (with noise) and 6 pointing elsewhere: the 6 are the ones kept; no query is read,
    # so a compacted cache's sparse positions and the absence of window queries change nothing
    gen = generator(1)
    common = torch.randn(16, generator=gen)
    keys = common + 0.05 * torch.randn(1, 36, 16, generator=gen)
    odd = [3, 9, 14, 20, 27, 31]
    keys[0, odd] = torch.randn(len(odd), 16, generator=gen) * common.norm()
    positions = sparse_positions(1, 36, 500, 0, seed=2)
    obs = observation(keys, torch.randn(1, 36, 16, generator=gen), positions)
    assert KeyDiff(window=0).keep_indices(obs, len(odd))[0].tolist() == odd


def test_keydiff_scores_do_not_depend_on_key_norms():
    gen = generator(4)
    keys = torch.randn(2, 50, 16, generator=gen)
    scaled = keys * (0.1 + 10 * torch.rand(2, 50, 1, generator=gen))  # every key's length changed, not its direction
    policy = KeyDiff(window=0)
    plain = policy.score(observation(keys, keys, dense_positions(2, 50)))
    stretched = policy.score(observation(scaled, scaled, dense_positions(2, 50)))
    assert torch.allclose(plain, stretched, atol=1e-5)
    assert plain.min() >= -1 - 1e-6 and plain.max() <= 1 + 1e-6  # minus a cosine
    assert not math.isclose(float(plain.std()), 0.0)
