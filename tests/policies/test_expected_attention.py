"""Expected Attention ("Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution", Devoto, Jeblick and Jégou 2025, arXiv:2510.00636) against references written from the paper's
equations: explicit rotation matrices per position in float64, the Gaussian's moments by loops, and a Monte Carlo
estimate of the expected exponentiated logit that the closed form stands for."""

from __future__ import annotations

import math

import pytest
import torch
from references import F64, as_lists, generator, ref_top

from kvserve.policies import ExpectedAttention, LayerObservation
from kvserve.policies.rotary import Rotary

THETA = 10000.0


def rotation_matrix(position: int, dim: int, neox: bool = True, theta: float = THETA) -> torch.Tensor:
    """RoPE's [D, D] matrix at one position, entry by entry (float64)."""
    matrix = torch.zeros(dim, dim, dtype=F64)
    for pair in range(dim // 2):
        angle = position * theta ** (-2 * pair / dim)
        first, second = (pair, pair + dim // 2) if neox else (2 * pair, 2 * pair + 1)
        matrix[first, first] = matrix[second, second] = math.cos(angle)
        matrix[second, first], matrix[first, second] = math.sin(angle), -math.sin(angle)
    return matrix


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_rotates_as_the_matrices_and_unrotates_back(neox):
    dim, positions = 16, torch.tensor([0, 3, 17, 250])
    rotary = Rotary.default(dim, THETA, 300)
    rotary = Rotary(rotary.cos, rotary.sin, neox=neox)
    x = torch.randn(len(positions), 2, dim, generator=generator(1))
    cos, sin = rotary.cos[positions][:, None], rotary.sin[positions][:, None]
    rotated = rotary.apply(x, cos, sin)
    for row, position in enumerate(positions.tolist()):
        expected = x[row].to(F64) @ rotation_matrix(position, dim, neox).T
        torch.testing.assert_close(rotated[row].to(F64), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotary.rotate(x, positions), rotated)  # the table's rotation at those positions
    torch.testing.assert_close(rotary.unrotate(rotated, positions), x, rtol=1e-5, atol=1e-5)
    scaled = Rotary(rotary.cos * 1.3, rotary.sin * 1.3, neox=neox)  # YaRN-style magnitude: still inverted
    torch.testing.assert_close(scaled.unrotate(scaled.apply(x, cos * 1.3, sin * 1.3), positions), x)


def test_mean_matrix_is_the_average_rotation_and_leaves_unrotated_dims_alone():
    dim, rotary_dim, first, count = 12, 8, 40, 25
    rotary = Rotary.default(dim, THETA, 100, rotary_dim=rotary_dim)
    expected = torch.eye(dim, dtype=F64)
    expected[:rotary_dim, :rotary_dim] = (
        sum(rotation_matrix(t, rotary_dim) for t in range(first, first + count)) / count
    )
    torch.testing.assert_close(rotary.mean_matrix(first, count, dim).to(F64), expected, rtol=1e-5, atol=1e-6)
    clipped = sum(rotation_matrix(t, rotary_dim) for t in range(90, 100)) / 10  # past the table: its last rows
    torch.testing.assert_close(
        rotary.mean_matrix(90, 50, dim)[:rotary_dim, :rotary_dim].to(F64), clipped, atol=1e-6, rtol=1e-5
    )


def inputs(heads=2, group=3, dim=8, n=60, window=16, seed=0):
    """Keys/values [H, n, D], unrotated window queries [w, H*G, D] at the last w positions, and the observation the
    engine builds from them (the window rotated to where the model computed it)."""
    gen = generator(seed)
    keys = torch.randn(heads, n, dim, generator=gen)
    values = torch.randn(heads, n, dim, generator=gen)
    plain_queries = torch.randn(window, heads * group, dim, generator=gen) + torch.randn(
        heads * group, dim, generator=gen
    )
    query_positions = torch.arange(n - window, n)
    rotary = Rotary.default(dim, THETA, 4096)
    obs = LayerObservation(
        layer_idx=0,
        keys=keys,
        values=values,
        positions=torch.arange(n).expand(heads, n).clone(),
        scale=dim**-0.5,
        window_queries=rotary.rotate(plain_queries, query_positions),
        window_positions=query_positions,
        rotary=rotary,
    )
    return obs, plain_queries


def ref_scores(obs: LayerObservation, plain_queries: torch.Tensor, future: int, sinks: int) -> torch.Tensor:
    """The paper's score from its equations, in float64 with loops over heads and keys."""
    heads, n, dim = obs.keys.shape
    group = plain_queries.shape[1] // heads
    next_position = int(obs.window_positions.max()) + 1
    mean_rotation = sum(rotation_matrix(t, dim) for t in range(next_position, next_position + future)) / future
    scores = torch.zeros(heads, n, dtype=F64)
    for h in range(heads):
        for g in range(group):
            samples = plain_queries[:, h * group + g].to(F64)
            mu = samples.mean(dim=0)
            sigma = sum(torch.outer(q - mu, q - mu) for q in samples) / len(samples)
            mu, sigma = mean_rotation @ mu, mean_rotation @ sigma @ mean_rotation.T
            logits = torch.full((n,), -math.inf, dtype=F64)
            for j in range(sinks, n):
                k = obs.keys[h, j].to(F64)
                logits[j] = obs.scale * (mu @ k) + obs.scale**2 * (k @ sigma @ k) / 2
            scores[h] += torch.softmax(logits, dim=0) / group
        scores[h] *= obs.values[h].to(F64).norm(dim=-1)
    return scores


@pytest.mark.parametrize("future,seed", [(1, 0), (64, 1), (512, 2)])
def test_scores_and_kept_set_match_the_papers_equations(future, seed):
    obs, plain_queries = inputs(seed=seed)
    policy = ExpectedAttention(window=16, future=future, sink_tokens=4)
    scores = policy.score(obs).to(F64)
    expected = ref_scores(obs, plain_queries, future, sinks=4)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-7)
    budget = 30
    keep = policy.keep_indices(obs, budget)
    kept_always = [*range(4), *range(obs.num_tokens - 16, obs.num_tokens)]  # the sinks and the window's tokens
    assert as_lists(keep) == [ref_top(expected[h], kept_always, budget) for h in range(obs.num_heads)]


def test_the_closed_form_is_the_expected_exponentiated_logit_of_a_gaussian_query():
    # One future position (future=1): a future query is exactly R_t q with q ~ N(mu, Sigma), so the closed form
    # exp(s k.mu' + s^2 k^T Sigma' k / 2) must equal E[exp(s q_t . k)] estimated from many sampled queries.
    obs, plain_queries = inputs(heads=1, group=1, dim=8, n=24, window=16, seed=5)
    policy = ExpectedAttention(window=16, future=1, sink_tokens=0)
    mean, covariance = policy.future_query_statistics(obs)
    gen = generator(6)
    mu = plain_queries[:, 0].to(F64).mean(dim=0)
    centred = plain_queries[:, 0].to(F64) - mu
    factor = torch.linalg.cholesky(centred.T @ centred / 16 + 1e-9 * torch.eye(8, dtype=F64))
    samples = mu + torch.randn(400_000, 8, generator=gen, dtype=F64) @ factor.T
    future_queries = samples @ rotation_matrix(int(obs.window_positions.max()) + 1, 8).T
    keys = obs.keys[0].to(F64)
    sampled = torch.exp(obs.scale * future_queries @ keys.T).mean(dim=0)
    closed = torch.exp(
        obs.scale * keys @ mean[0, 0].to(F64)
        + obs.scale**2 * torch.einsum("nd,de,ne->n", keys, covariance[0, 0].to(F64), keys) / 2
    )
    torch.testing.assert_close(closed, sampled, rtol=0.02, atol=0)
    expected = ref_scores(obs, plain_queries, future=1, sinks=0)[0]
    torch.testing.assert_close(policy.score(obs)[0].to(F64), expected, rtol=1e-4, atol=1e-7)


def test_sinks_are_kept_and_take_no_part_and_the_sinks_queries_are_left_out():
    obs, _ = inputs(n=40, window=40, seed=3)  # the window reaches back to position 0
    policy = ExpectedAttention(window=40, sink_tokens=4)
    scores = policy.score(obs)
    assert bool((scores[:, :4] == 0).all())  # out of the softmax
    small_window, _ = inputs(n=40, window=8, seed=3)
    keep = ExpectedAttention(window=8, sink_tokens=4).keep_indices(small_window, 16)
    assert all(row[:4] == [0, 1, 2, 3] and row[-8:] == list(range(32, 40)) for row in as_lists(keep))
    moved = obs.window_queries.clone()
    moved[:4] *= 50  # the sinks' own queries are outliers the statistics ignore
    same = policy.score(LayerObservation(**{**obs.__dict__, "window_queries": moved}))
    torch.testing.assert_close(same, scores)


def test_a_layer_without_a_rope_table_is_refused_with_the_reason():
    obs, _ = inputs()
    with pytest.raises(ValueError, match="RoPE"):
        ExpectedAttention().score(LayerObservation(**{**obs.__dict__, "rotary": None}))
