"""What every registered policy promises the engine, checked over the registry: a policy added to
`kvserve.policies.BASE_POLICIES` is covered here without editing this file.

- Declaration: a frozen dataclass whose every field is a knob (int, float or str, with help text), whose default
  settings are valid, and whose statistics and pass measurements are ones the engine knows.
- Selection: exactly `budget` entries per head, as ascending, distinct cache indices, whose positions therefore
  ascend too; a budget that covers the cache keeps everything, unchanged.
- Determinism: the same observation gives the same selection, and the policy does not modify its inputs.
- Ties: identical heads keep identical entries; a score-based policy breaks equal scores towards the earlier token.
- Knob validation: every value a knob's declaration refuses is refused by the request parser with an error that names
  the request key, and every value it allows is accepted.
- A ragged policy (its heads keep different counts) instead keeps, per head, what its flags allow, newest first under
  a cap, as ascending indices.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvserve.config import parse_kv_config
from kvserve.errors import InvalidSetting
from kvserve.model import DEFAULT_MODEL_NAME
from kvserve.policies import POLICIES, LayerObservation, Policy, ScoredPolicy
from kvserve.policies.base import PassStatistics
from kvserve.policies.rotary import Rotary

HEADS, GROUP, DIM, LENGTH, LAYER = 3, 2, 16, 192, 3
PREFILL = LENGTH - 8  # a prompt chunk, then single-token decode steps, as the engine feeds statistics
BUDGETED = sorted(name for name, cls in POLICIES.items() if not cls.ragged and not cls.own_counts)
RAGGED = sorted(name for name, cls in POLICIES.items() if cls.ragged)
OWN_COUNTS = sorted(name for name, cls in POLICIES.items() if cls.own_counts)  # counts per head from trained roles


@pytest.fixture(autouse=True)
def synthetic_surrogates(monkeypatch) -> None:
    """KVzap's surrogates for these layers' shape (the shipped ones read the served model's query heads). Every KV
    head's predictor is the same, so that identical heads (the ties test) are identical to KVzap too."""
    from kvserve.kvzap import registry
    from kvserve.kvzap.surrogate import Surrogate, SurrogateSet

    torch.manual_seed(0)
    layers = [Surrogate(HEADS * GROUP * DIM, HEADS, None) for _ in range(LAYER + 1)]
    with torch.no_grad():
        for layer in layers:
            layer.net.weight.copy_(layer.net.weight[:1].expand_as(layer.net.weight))
            layer.net.bias.fill_(0.0)
    monkeypatch.setattr(registry, "surrogates_for", lambda model: SurrogateSet("linear", {}, layers))


def budget_for(policy: Policy) -> int:
    """A budget that evicts: above what the policy always keeps, below the cache length."""
    budget = policy.protected_tokens() + 16
    assert budget < LENGTH, f"{policy.name}'s defaults protect {policy.protected_tokens()} of {LENGTH} entries"
    return budget


def inputs(seed: int, tied: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys, values [H, n, D] and queries [n, H*G, D]; `tied`: every entry and query the same, in every head."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(HEADS, LENGTH, DIM, generator=generator)
    values = torch.randn(HEADS, LENGTH, DIM, generator=generator)
    queries = torch.randn(LENGTH, HEADS * GROUP, DIM, generator=generator)
    if tied:
        keys, values = keys[:1, :1].expand_as(keys), values[:1, :1].expand_as(values)
        queries = queries[:1, :1].expand_as(queries)
    return keys.contiguous(), values.contiguous(), queries.contiguous()


def observe(
    policy: Policy, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, budget: int
) -> LayerObservation:
    """The observation the engine builds at a compaction: statistics folded in step by step (a prefill chunk, then
    one query at a time), the policy's window of newest queries, and the budget."""
    positions = torch.arange(LENGTH).expand(HEADS, LENGTH)
    rotary = Rotary.default(DIM, 10000.0, 2 * LENGTH)  # the engine gives every layer of a RoPE model its table
    stats = {name: torch.zeros(HEADS, 0) for name in policy.stat_names}
    for start, end in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, LENGTH)]:
        padded = {name: torch.nn.functional.pad(stat, (0, end - stat.shape[1])) for name, stat in stats.items()}
        obs = LayerObservation(
            LAYER, keys[:, :end], values[:, :end], positions[:, :end], DIM**-0.5, stats=padded, rotary=rotary
        )
        stats = policy.update_stats(obs, queries[start:end], torch.arange(start, end))
        assert set(stats) == set(policy.stat_names)
        assert all(stat.shape == (HEADS, end) for stat in stats.values()), policy.name
    window = max(policy.window_size(), 1)
    return LayerObservation(
        LAYER,
        keys,
        values,
        positions,
        DIM**-0.5,
        window_queries=queries[-window:],
        window_positions=torch.arange(LENGTH - window, LENGTH),
        stats=stats,
        budget=budget,
        rotary=rotary,
        model=DEFAULT_MODEL_NAME,  # a model with shipped DuoAttention roles (3 KV heads, as here)
    )


def kept_rows(keep_indices: torch.Tensor) -> list[list[int]]:
    return keep_indices.tolist()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_declares_its_settings_as_fields(name):
    cls = POLICIES[name]
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, f"{name}: a frozen dataclass"
    policy = cls()
    for field_name, setting in cls.knobs().items():
        assert setting.kind in (int, float, str) and setting.help, (name, field_name)
        assert setting.default is not None or setting.optional, (name, field_name)
        assert getattr(policy, field_name) == setting.default
        assert setting.key == "kv_" + field_name
    with pytest.raises(dataclasses.FrozenInstanceError):  # a request's policy cannot change under it
        policy.window = 1
    assert set(cls.pass_statistics) <= {f.name for f in dataclasses.fields(PassStatistics)}, name
    settings = {"kv_policy": name} if cls.ragged else {"kv_policy": name, "kv_budget": budget_for(policy)}
    assert parse_kv_config(settings, defaults={}).make_policy() == policy


@pytest.mark.parametrize("name", BUDGETED)
@pytest.mark.parametrize("seed", [0, 1])
def test_keeps_exactly_the_budget_as_ascending_distinct_indices(name, seed):
    policy = POLICIES[name]()
    budget = budget_for(policy)
    keys, values, queries = inputs(seed)
    obs = observe(policy, keys, values, queries, budget)
    selection = policy.select(obs, budget)
    keep = selection.keep_indices
    assert keep.shape == (HEADS, budget) and keep.dtype == torch.long, name
    assert selection.keep_counts is None, name
    assert bool((keep >= 0).all() and (keep < LENGTH).all()), name
    assert bool((keep[:, 1:] > keep[:, :-1]).all()), f"{name}: indices must ascend strictly (distinct, in order)"
    kept_positions = obs.positions.gather(1, keep)
    assert bool((kept_positions[:, 1:] > kept_positions[:, :-1]).all()), name
    if selection.keys is not None:  # a merging policy rewrites the kept entries
        assert selection.keys.shape == selection.values.shape == (HEADS, budget, DIM), name
        assert set(selection.stats or {}) == set(policy.stat_names), name


@pytest.mark.parametrize("name", BUDGETED)
def test_a_budget_covering_the_cache_keeps_it_unchanged(name):
    policy = POLICIES[name]()
    keys, values, queries = inputs(2)
    selection = policy.select(observe(policy, keys, values, queries, LENGTH), LENGTH)
    assert kept_rows(selection.keep_indices) == [list(range(LENGTH))] * HEADS, name
    if selection.keys is not None:
        torch.testing.assert_close(selection.keys, keys)
        torch.testing.assert_close(selection.values, values)


@pytest.mark.parametrize("name", BUDGETED + OWN_COUNTS)
def test_same_observation_same_selection_and_inputs_untouched(name):
    policy = POLICIES[name]()
    budget = budget_for(policy)
    obs = observe(policy, *inputs(3), budget)
    before = [tensor.clone() for tensor in (obs.keys, obs.values, obs.window_queries, *obs.stats.values())]
    first, second = policy.select(obs, budget), POLICIES[name]().select(obs, budget)
    assert torch.equal(first.keep_indices, second.keep_indices), name
    if first.keys is not None:
        assert torch.equal(first.keys, second.keys) and torch.equal(first.values, second.values), name
    after = (obs.keys, obs.values, obs.window_queries, *obs.stats.values())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), f"{name} modified its observation"


@pytest.mark.parametrize("name", BUDGETED)
def test_ties_identical_heads_keep_the_same_entries_and_scores_favour_the_earlier_token(name):
    policy = POLICIES[name]()
    budget = budget_for(policy)
    obs = observe(policy, *inputs(4, tied=True), budget)
    keep = policy.select(obs, budget).keep_indices
    assert all(row == kept_rows(keep)[0] for row in kept_rows(keep)), f"{name}: identical heads kept different entries"
    if isinstance(policy, ScoredPolicy):  # the protected entries, then by score, equal scores in token order
        scores, protected = policy.score(obs)[0].tolist(), policy.protected_mask(obs)[0].tolist()
        ranked = sorted(range(LENGTH), key=lambda index: (not protected[index], -scores[index], index))
        assert kept_rows(keep)[0] == sorted(ranked[:budget]), f"{name}: equal scores must go to the earlier token"


def refused_values(setting) -> list:
    """Values the declaration rules out: the wrong type, out of range, even where odd, not among the choices."""
    if setting.kind is str:
        return [3, "not-" + "-".join(setting.choices or ("a-value",))] if setting.choices else [3]
    refused: list = ["many", True] + ([] if setting.optional else [None])
    if setting.kind is int and setting.default is not None:
        refused.append(setting.default + 0.5)
    else:
        refused += [math.nan, math.inf]
    if setting.minimum is not None:
        refused.append(setting.minimum - 1)
    if setting.maximum is not None:
        refused.append(setting.maximum + 1)
    if setting.odd:
        refused.append(setting.default + 1)
    return refused


def allowed_values(setting) -> list:
    """Values the declaration allows: the default, the bounds, the choices, the default written as a header."""
    if setting.kind is str:
        return list(setting.choices or (setting.default,))
    if setting.optional:  # off (None), or a value of its kind, given as a number or as a header's text
        return [None, setting.kind(1), "-2"] if setting.minimum is None else [None, setting.kind(setting.minimum)]
    allowed = [setting.default, str(setting.default)]
    for bound in (setting.minimum, setting.maximum):
        if bound is not None and (not setting.odd or bound % 2 == 1):
            allowed.append(setting.kind(bound))
    return allowed


KNOBS = [(name, key) for name in sorted(POLICIES) for key in POLICIES[name].knobs()]


@pytest.mark.parametrize("name,knob_name", KNOBS)
def test_every_value_a_knob_refuses_is_a_400_naming_its_key(name, knob_name):
    setting = POLICIES[name].knobs()[knob_name]
    budget = {} if POLICIES[name].ragged else {"kv_budget": 200}
    for value in refused_values(setting):
        with pytest.raises(InvalidSetting) as error:
            parse_kv_config({"kv_policy": name, **budget, setting.key: value}, defaults={})
        assert error.value.field == setting.key, (name, value, error.value)
        with pytest.raises(InvalidSetting):  # the dataclass checks the same, for code that builds a policy itself
            POLICIES[name](**{knob_name: value})
    for value in allowed_values(setting):
        config = parse_kv_config({"kv_policy": name, **budget, setting.key: value}, defaults={})
        expected = None if value is None else setting.kind(value)
        assert dict(config.knobs)[knob_name] == expected, (name, value)


@pytest.mark.parametrize("name", RAGGED)
@pytest.mark.parametrize("cap", [None, 5])
def test_a_ragged_policy_keeps_each_heads_flagged_entries_newest_first_under_a_cap(name, cap):
    flags = torch.rand(HEADS, 24, generator=torch.Generator().manual_seed(5)) < 0.5
    flags[0] = False  # a head whose gate flags nothing keeps nothing
    keep, counts = POLICIES[name]().ragged_keep(flags, cap)
    for head in range(HEADS):
        flagged = torch.nonzero(flags[head]).flatten().tolist()
        expected = flagged[-cap:] if cap is not None and len(flagged) > cap else flagged
        assert int(counts[head]) == len(expected)
        assert keep[head, : len(expected)].tolist() == expected, (name, head)


@pytest.mark.parametrize("name", OWN_COUNTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_policy_with_its_own_counts_keeps_them_as_ascending_distinct_indices(name, seed):
    policy = POLICIES[name]()
    budget = budget_for(policy)
    obs = observe(policy, *inputs(seed), budget)
    selection = policy.select(obs, budget)
    counts = policy.head_counts(obs, budget)
    assert torch.equal(selection.keep_counts, counts), name
    assert bool((counts <= LENGTH).all()) and int(counts.max()) > 0, name
    for head, row in enumerate(kept_rows(selection.keep_indices)):
        kept = row[: int(counts[head])]
        assert kept == sorted(set(kept)) and all(0 <= index < LENGTH for index in kept), (name, head)
