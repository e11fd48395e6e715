"""Allocations (`kv_allocation`) and spans (`kv_span`) against plain-loop implementations of their rules: Ada-KV's
head-wise split with a floor (arXiv:2407.11550), one ranking across layers (as KV-Compress, arXiv:2410.00161),
PyramidKV's linear schedule (arXiv:2406.02069) and ChunkKV's span scores (arXiv:2502.00299)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from kvserve.policies.allocation import (
    FLOOR_SHARE,
    PYRAMID_BETA,
    head_floor,
    normalised,
    pyramid_budgets,
    ranked,
    shares,
    span_scores,
    top_counts,
    whole_pages,
)


def ref_order(keys_row: list[float]) -> list[int]:
    """A head's entries best first; equal keys in token order."""
    return sorted(range(len(keys_row)), key=lambda i: (-keys_row[i], i))


def ref_shares(layers: list[list[list[float]]], limits: list[list[int]], total: int, floor: int) -> list[list[int]]:
    """The rule in words: each (layer, head) keeps its best `floor` (all it holds if fewer); the best remaining keys
    over everything fill the rest; ties to the earlier layer, head, token rank."""
    counts = [[min(floor, limit) for limit in layer_limits] for layer_limits in limits]
    pool = []
    for layer, heads in enumerate(layers):
        for head, row in enumerate(heads):
            for rank, index in enumerate(ref_order(row)):
                if counts[layer][head] <= rank < limits[layer][head]:
                    pool.append((-row[index], layer, head, rank))
    for _, layer, head, _ in sorted(pool)[: total - sum(map(sum, counts))]:
        counts[layer][head] += 1
    return counts


def random_scores(heads: int, n: int, seed: int, ties: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(heads, n, generator=generator)
    return (scores * 4).round() / 4 if ties else scores  # a few distinct values: many ties


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ties", [False, True])
def test_heads_allocation_matches_the_plain_rule_keeps_h_times_b_and_the_floor(seed, ties):
    heads, n, budget, window = 4, 40, 12, 3
    scores = random_scores(heads, n, seed, ties)
    protected = torch.zeros(heads, n, dtype=torch.bool)
    protected[:, -window:] = True
    keys = ranked(scores, protected, None)
    floor = head_floor(budget, window)
    limits = torch.full((heads,), n)
    (counts,) = shares([keys], heads * budget, floor, [limits])
    assert counts.tolist() == ref_shares([keys.tolist()], [limits.tolist()], heads * budget, floor)[0]
    assert int(counts.sum()) == heads * budget and int(counts.min()) >= floor == max(window, math.ceil(0.2 * budget))
    keep = top_counts(keys, counts)
    for head in range(heads):
        kept = keep[head, : counts[head]].tolist()
        assert kept == sorted(ref_order(keys[head].tolist())[: counts[head]])
        assert set(range(n - window, n)) <= set(kept)  # protected entries survive whatever the share


@pytest.mark.parametrize("seed", range(4))
def test_global_allocation_ranks_normalised_scores_across_layers(seed):
    layers, heads, n, budget, window = 5, 3, 30, 8, 2
    generator = torch.Generator().manual_seed(seed)
    scale = [float(10**k) for k in range(layers)]  # raw scores of very different size per layer
    raw = [torch.rand(heads, n, generator=generator) * scale[layer] for layer in range(layers)]
    protected = torch.zeros(heads, n, dtype=torch.bool)
    protected[:, -window:] = True
    keys = [ranked(normalised(scores, protected, None), protected, None) for scores in raw]
    floor = head_floor(budget, window)
    limits = [torch.full((heads,), n)] * layers
    counts = shares(keys, layers * heads * budget, floor, limits)
    # the reference normalises by itself: a layer's unprotected scores divided by their sum
    reference_keys = []
    for scores in raw:
        free_total = sum(v for row in scores[:, :-window].tolist() for v in row)
        reference_keys.append(
            [[v / free_total for v in row[:-window]] + [math.inf] * window for row in scores.tolist()]
        )
    expected = ref_shares(reference_keys, [[n] * heads] * layers, layers * heads * budget, floor)
    assert [c.tolist() for c in counts] == expected
    assert sum(int(c.sum()) for c in counts) == layers * heads * budget
    assert min(int(c.min()) for c in counts) >= floor
    # normalising matters: without it the largest-scored layer would take nearly everything beyond the floors
    unnormalised = shares([ranked(s, protected, None) for s in raw], layers * heads * budget, floor, limits)
    assert int(unnormalised[-1].sum()) > int(counts[-1].sum())


def test_shares_of_heads_holding_fewer_entries_than_the_floor():
    keys = torch.tensor([[3.0, 2.0, 1.0, 0.0], [9.0, -math.inf, -math.inf, -math.inf]])  # head 1 holds one entry
    (counts,) = shares([keys], 6, 2, [torch.tensor([4, 1])])
    assert counts.tolist() == [4, 1]  # head 1 keeps all it has; the rest of the total goes where entries exist


def ref_whole_pages(counts: list[int], total_pages: int, page: int, min_pages: int, limits: list[int]) -> list[int]:
    """The rounding in words, with exact fractions: each list's count in pages, at least `min_pages` and at most the
    whole pages it holds; then one page at a time to the list with the largest remainder (earliest first) until
    `total_pages`, or from the list with the smallest remainder (earliest first) while over."""
    exact = [Fraction(count, page) for count in counts]
    most = [limit // page for limit in limits]
    low = [min(min_pages, m) for m in most]
    pages = [min(max(math.floor(e), lo), m) for e, lo, m in zip(exact, low, most, strict=True)]
    while sum(pages) < total_pages and any(p < m for p, m in zip(pages, most, strict=True)):
        i = max((i for i in range(len(pages)) if pages[i] < most[i]), key=lambda i: (exact[i] - pages[i], -i))
        pages[i] += 1
    while sum(pages) > total_pages and any(p > lo for p, lo in zip(pages, low, strict=True)):
        i = min((i for i in range(len(pages)) if pages[i] > low[i]), key=lambda i: (exact[i] - pages[i], i))
        pages[i] -= 1
    return [p * page for p in pages]


@pytest.mark.parametrize("seed", range(6))
def test_whole_pages_rounds_a_global_ranking_to_pages_keeping_the_total(seed):
    generator = torch.Generator().manual_seed(seed)
    layers, heads, budget, page = 4, 3, 64, 16
    scores = [torch.rand(heads, 300, generator=generator) ** (1 + layer) for layer in range(layers)]
    limits = [torch.full((heads,), 300) for _ in range(layers)]
    protected = torch.zeros(heads, 300, dtype=torch.bool)
    counts = shares([ranked(s, protected, None) for s in scores], layers * heads * budget, page, limits)
    pages = whole_pages(counts, layers * heads * budget // page, page, 1, limits)
    flat = [int(c) for layer in pages for c in layer]
    assert sum(flat) == layers * heads * budget and all(c % page == 0 and c >= page for c in flat)
    expected = ref_whole_pages(
        [int(c) for layer in counts for c in layer], layers * heads * budget // page, page, 1, [300] * layers * heads
    )
    assert flat == expected
    assert all(abs(p - int(c)) < page for p, c in zip(flat, (int(c) for layer in counts for c in layer), strict=True))


def test_whole_pages_never_gives_a_list_more_pages_than_it_holds():
    counts = [torch.tensor([40, 10, 10])]
    pages = whole_pages(counts, 4, 16, 1, [torch.tensor([40, 16, 300])])
    assert pages[0].tolist() == [32, 16, 16]  # 40 entries hold two whole pages only


@pytest.mark.parametrize(
    "budget,layers,minimum",
    [(64, 30, 33), (256, 30, 33), (100, 7, 5), (40, 2, 1), (9, 1, 4), (1024, 30, 33), (35, 30, 33)],
)
def test_pyramid_budgets_are_linear_sum_to_l_times_b_and_respect_the_minimum(budget, layers, minimum):
    budgets = pyramid_budgets(budget, layers, minimum)
    assert len(budgets) == layers and sum(budgets) == layers * budget
    assert min(budgets) >= min(minimum, budget)
    assert all(a >= b for a, b in zip(budgets, budgets[1:], strict=False))  # never more in a deeper layer
    if layers > 1:
        low = min(budget, max(minimum, budget // PYRAMID_BETA))
        exact = [
            Fraction(2 * budget - low) - Fraction(2 * budget - 2 * low, layers - 1) * layer for layer in range(layers)
        ]
        assert all(abs(b - e) < 1 for b, e in zip(budgets, exact, strict=True))  # the line, rounded


def test_span_scores_sum_each_span_per_head():
    generator = torch.Generator().manual_seed(3)
    scores = torch.rand(2, 23, generator=generator)
    positions = torch.stack([torch.arange(23), torch.tensor([p if p % 5 else -1 for p in range(23)])])
    positions[1, 20:] = -1  # head 1: padding at the end and a few evicted positions
    got = span_scores(scores, positions, 4)
    for head in range(2):
        for index in range(23):
            position = int(positions[head, index])
            if position < 0:
                assert got[head, index] == scores[head, index]
                continue
            members = [j for j in range(23) if positions[head, j] >= 0 and positions[head, j] // 4 == position // 4]
            torch.testing.assert_close(got[head, index], scores[head, members].sum())
    assert torch.equal(span_scores(scores, positions, 1), scores)


def test_span_ranking_keeps_whole_spans_the_earliest_part_of_the_last():
    scores = torch.tensor([[0.1, 0.1, 5.0, 0.1, 0.1, 0.1, 1.0, 1.0, 0.2, 0.2, 0.2, 0.2]])
    positions = torch.arange(12)[None, :]
    keys = ranked(span_scores(scores, positions, 4), torch.zeros_like(scores, dtype=torch.bool), None)
    keep = top_counts(keys, torch.tensor([6]))
    # spans: [0..3] sums 5.3, [4..7] 2.2, [8..11] 0.8: the first span whole, then the second's first two
    assert keep.tolist() == [[0, 1, 2, 3, 4, 5]]


def test_floor_share_is_adakvs_safeguard():
    assert FLOOR_SHARE == 0.2 and head_floor(100, 3) == 20 and head_floor(100, 32) == 32 and head_floor(10, 30) == 10
