"""TOVA ("Transformers are Multi-State RNNs", Oren et al. 2024, arXiv:2401.06104) against a dense reference: the
kept set is the top of the newest window query's attention row, averaged over the group's query heads, causal by
position (dense and compacted caches)."""

from __future__ import annotations

import pytest
import torch
from references import (
    as_lists,
    causal_inputs,
    dense_positions,
    observation,
    ref_top,
    ref_tova_scores,
    sparse_positions,
)

from kvserve.policies import TOVA


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("group,budget", [(1, 10), (3, 17)])
def test_tova_keeps_top_of_last_query_row_mean_over_group(window, sparse, group, budget):
    heads, n, dim = 3, 40, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=40 + group)
    positions = sparse_positions(heads, n, 100, window, seed=41) if sparse else dense_positions(heads, n)
    obs = observation(keys, values, positions, queries[-window:], positions[0, -window:].clone(), budget=budget)
    keep = TOVA().keep_indices(obs, budget)
    reference = ref_tova_scores(obs)  # the newest (last) window query only
    assert as_lists(keep) == [ref_top(reference[h], [], budget) for h in range(heads)]


def test_tova_window_query_older_than_some_entries_is_causal():
    # A window query older than entries appended after it must not see them (causal by position, not by slot).
    heads, group, n, dim = 2, 2, 30, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=43)
    positions = dense_positions(heads, n)
    obs = observation(keys, values, positions, queries[20:21], torch.tensor([20]), budget=12)
    keep = TOVA().keep_indices(obs, 12)
    reference = ref_tova_scores(obs)
    assert as_lists(keep) == [ref_top(reference[h], [], 12) for h in range(heads)]


@pytest.mark.parametrize("group,budget", [(1, 10), (3, 17)])
def test_tova_layer_scope_keeps_the_top_of_the_layers_mean_row_in_every_head(group, budget):
    """`vote_scope=layer` (TOVA's own code, kvpress's TOVAPress): every KV head keeps the top of the newest query's
    attention averaged over all of the layer's query heads, the same positions in each head."""
    heads, n, dim = 3, 40, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=44 + group)
    positions = dense_positions(heads, n)
    obs = observation(keys, values, positions, queries[-1:], positions[0, -1:].clone(), budget=budget)
    keep = TOVA(vote_scope="layer").keep_indices(obs, budget)
    layer_mean = ref_tova_scores(obs).mean(dim=0)  # groups of equal size: the mean of the group means
    assert as_lists(keep) == [ref_top(layer_mean, [], budget)] * heads
    assert as_lists(keep) != as_lists(TOVA().keep_indices(obs, budget))  # the group scope keeps others here
