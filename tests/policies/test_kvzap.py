"""KVzap (arXiv:2601.07891) as a policy, on synthetic layers with a random surrogate: each step's queries, un-rotated,
score the step's new entries through the layer's surrogate; a budget keeps the window and the best predictions, a
threshold keeps the window and exactly the entries predicted at or above it, capped by the budget; the settings
that cannot apply with a threshold are refused naming their key."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import parse_kv_config
from kvserve.errors import InvalidSetting
from kvserve.kvzap import registry
from kvserve.kvzap.surrogate import Surrogate, SurrogateSet
from kvserve.policies import LayerObservation
from kvserve.policies.kvzap import STAT, KVzap
from kvserve.policies.rotary import Rotary

HEADS, GROUP, DIM, LENGTH, LAYERS = 3, 2, 16, 96, 2


@pytest.fixture
def surrogates(monkeypatch) -> SurrogateSet:
    torch.manual_seed(0)
    layers = [Surrogate(HEADS * GROUP * DIM, HEADS, hidden) for hidden in (None, 8)]  # linear, then an MLP
    made = SurrogateSet("mixed", {"name": "synthetic"}, layers)
    monkeypatch.setattr(registry, "surrogates_for", lambda model: made)
    return made


def fold(policy: KVzap, queries: torch.Tensor, layer: int, steps: list[tuple[int, int]]) -> LayerObservation:
    """The observation after the engine fed `steps` (query ranges) to update_stats, as a compaction sees it."""
    rotary = Rotary.default(DIM, 10000.0, 2 * LENGTH)
    end = steps[-1][1]
    stats = {STAT: torch.zeros(HEADS, 0)}
    keys = torch.zeros(HEADS, end, DIM)
    for start, stop in steps:
        padded = {STAT: torch.nn.functional.pad(stats[STAT], (0, stop - stats[STAT].shape[1]))}
        positions = torch.arange(stop).expand(HEADS, stop)
        obs = LayerObservation(layer, keys[:, :stop], keys[:, :stop], positions, DIM**-0.5, stats=padded, rotary=rotary)
        stats = policy.update_stats(obs, queries[start:stop], torch.arange(start, stop))
    positions = torch.arange(end).expand(HEADS, end)
    return LayerObservation(layer, keys, keys, positions, DIM**-0.5, stats=stats, rotary=rotary)


def plain_queries(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries before RoPE [n, Hq, D] and the same rotated by position, as the attention pass holds them."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randn(LENGTH, HEADS * GROUP, DIM, generator=generator)
    rotary = Rotary.default(DIM, 10000.0, 2 * LENGTH)
    return raw, rotary.rotate(raw, torch.arange(LENGTH))


@pytest.mark.parametrize("layer", range(LAYERS))
def test_each_step_scores_its_new_entries_from_the_queries_before_rope(surrogates, layer):
    raw, rotated = plain_queries(1)
    steps = [(0, 64)] + [(t, t + 1) for t in range(64, LENGTH)]  # a prompt chunk, then decode steps
    obs = fold(KVzap(), rotated, layer, steps)
    expected = surrogates.layers[layer](raw.reshape(LENGTH, -1)).T.detach()
    torch.testing.assert_close(obs.stats[STAT], expected, rtol=1e-4, atol=1e-4)


def test_lists_of_different_lengths_get_each_heads_newest_entries_scored(surrogates):
    _, rotated = plain_queries(2)
    lengths = torch.tensor([10, 7, 9])  # after a compaction with per-head counts, then 2 new tokens each
    stat = torch.full((HEADS, 10), -50.0)
    positions = torch.arange(10).expand(HEADS, 10).clone()
    for head, length in enumerate(lengths.tolist()):
        stat[head, length:] = 0.0
        positions[head, length:] = -1
    obs = LayerObservation(
        0, torch.zeros(HEADS, 10, DIM), torch.zeros(HEADS, 10, DIM), positions, DIM**-0.5, stats={STAT: stat},
        lengths=lengths, rotary=Rotary.default(DIM, 10000.0, 2 * LENGTH),
    )  # fmt: skip
    new = rotated[20:22]
    written = KVzap().update_stats(obs, new, torch.arange(20, 22))[STAT]
    predicted = surrogates.scores(0, Rotary.default(DIM, 10000.0, 2 * LENGTH).unrotate(new, torch.arange(20, 22)))
    for head, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(written[head, length - 2 : length], predicted[head])
        assert bool((written[head, : length - 2] == -50.0).all())  # older entries keep their scores


@pytest.mark.parametrize("window", [0, 8])
def test_a_budget_keeps_the_window_and_the_best_predictions(surrogates, window):
    _, rotated = plain_queries(3)
    policy, budget = KVzap(window=window), 40
    obs = fold(policy, rotated, 0, [(0, LENGTH)])
    keep = policy.select(obs, budget).keep_indices
    scores = obs.stats[STAT]
    for head in range(HEADS):
        recent = set(range(LENGTH - window, LENGTH))
        rest = [i for i in torch.argsort(scores[head], descending=True, stable=True).tolist() if i not in recent]
        assert keep[head].tolist() == sorted(recent | set(rest[: budget - window]))


@pytest.mark.parametrize("budget", [30, LENGTH])
def test_a_threshold_keeps_exactly_the_passing_entries_capped_by_the_budget(surrogates, budget):
    _, rotated = plain_queries(4)
    obs = fold(KVzap(), rotated, 1, [(0, LENGTH)])
    scores = obs.stats[STAT]
    threshold = float(scores.median())
    policy = KVzap(window=8, threshold=threshold)
    selection = policy.select(obs, budget)
    for head in range(HEADS):
        passing = {i for i in range(LENGTH) if scores[head, i] >= threshold or i >= LENGTH - 8}
        count = int(selection.keep_counts[head])
        kept = selection.keep_indices[head, :count].tolist()
        assert kept == sorted(kept) and count == min(len(passing), budget)
        if len(passing) <= budget:
            assert set(kept) == passing
        else:  # the window, then the best-scored of the rest up to the cap
            by_score = sorted(passing - set(range(LENGTH - 8, LENGTH)), key=lambda i: -float(scores[head, i]))
            assert set(kept) == set(range(LENGTH - 8, LENGTH)) | set(by_score[: budget - 8])


def test_a_threshold_is_a_per_request_count_and_refuses_allocations_and_spans():
    plain = parse_kv_config({"kv_policy": "kvzap", "kv_budget": 256}, defaults={})
    assert not plain.own_counts and plain.make_policy().threshold is None
    config = parse_kv_config({"kv_policy": "kvzap", "kv_budget": 256, "kv_threshold": "-4.5"}, defaults={})
    assert config.own_counts and config.make_policy().threshold == -4.5
    for key, value in (("kv_allocation", "heads"), ("kv_span", 8)):
        with pytest.raises(InvalidSetting) as error:
            parse_kv_config({"kv_policy": "kvzap", "kv_budget": 256, "kv_threshold": -4, key: value}, defaults={})
        assert error.value.field == key and "threshold" in str(error.value)
    # without a threshold the budget may be allocated as any scored policy's
    assert parse_kv_config({"kv_policy": "kvzap", "kv_budget": 256, "kv_allocation": "global"}, defaults={})


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [DIM, DIM // 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_surrogate_reads_rotated_queries_as_it_reads_them_unrotated(surrogates, neox, rotary_dim, dtype):
    """The fold of RoPE's inverse into a linear surrogate (Rotary.unrotated_linear) against unrotating first, for
    both pair layouts, a partial rotation and a scaled table (YaRN's); the served queries are left as they were."""
    table = Rotary.default(DIM, 10000.0, 2 * LENGTH, rotary_dim=rotary_dim)
    rotary = Rotary(table.cos * 1.2, table.sin * 1.2, neox=neox)
    queries = torch.randn(LENGTH, HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(5)).to(dtype)
    positions = torch.randperm(2 * LENGTH, generator=torch.Generator().manual_seed(6))[:LENGTH]
    before = queries.clone()
    folded = surrogates.scores_of_rotated(0, queries, positions, rotary)
    torch.testing.assert_close(folded, surrogates.scores(0, rotary.unrotate(queries, positions)), rtol=1e-4, atol=1e-4)
    assert torch.equal(queries, before)
    assert surrogates.layers[1].linear is None  # the MLP reads unrotated queries: the same path as `scores`
    torch.testing.assert_close(
        surrogates.scores_of_rotated(1, queries, positions, rotary),
        surrogates.scores(1, rotary.unrotate(queries, positions)),
    )
