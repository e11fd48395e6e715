"""Inputs and dense references shared by the policy tests in this folder (the reference of a single policy lives in
that policy's test file).

Every reference is built from the papers' equations with plain loops and float64 tensor
code; none calls a policy's own helpers (`score`, `step_gain`, `global_local`, `caote_score`,
`LayerObservation.attention`). Policies run on small random tensors from seeded generators; the tests compare the
kept sets (and EMS's merged keys/values), then check the properties each paper states.

Conventions shared with the policies: H = KV heads, G = query heads per KV head (query head j belongs to KV head
j // G), ties in a ranking go to the earlier token.
"""

from __future__ import annotations

import math

import torch

from kvserve.policies import LayerObservation

F64 = torch.float64

# kvserve's reading of AhaKV (arXiv:2506.03762): the value-norm mean filter has an odd kernel of 7 and "same"
# padding, as SnapKV's pooling. SnapKV's pooling (SnapKV's code,
# torch's avg_pool1d with padding = k // 2) pads with zeros and divides by the full kernel size at the edges.
AHAKV_EDGE_DIVIDES_BY_KERNEL = True


# --------------------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------------------


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def causal_inputs(n, heads, group, dim, seed, dtype=torch.float32):
    """Keys/values [H, n, D] and one query per token [n, H*G, D]."""
    gen = generator(seed)
    keys = torch.randn(heads, n, dim, generator=gen, dtype=dtype)
    values = torch.randn(heads, n, dim, generator=gen, dtype=dtype)
    queries = torch.randn(n, heads * group, dim, generator=gen, dtype=dtype)
    return keys, values, queries


def dense_positions(heads, n):
    return torch.arange(n).expand(heads, n).clone()


def sparse_positions(heads, n, total, window, seed):
    """A compacted cache: per head an ascending random subset of [0, total), ending with the `window` newest."""
    gen = generator(seed)
    rows = []
    for _ in range(heads):
        older = torch.sort(torch.randperm(total - window, generator=gen)[: n - window]).values
        rows.append(torch.cat([older, torch.arange(total - window, total)]))
    return torch.stack(rows)


def observation(keys, values, positions, window_queries=None, window_positions=None, stats=None, budget=0, layer_idx=0):
    return LayerObservation(
        layer_idx=layer_idx,
        keys=keys,
        values=values,
        positions=positions,
        scale=keys.shape[-1] ** -0.5,
        window_queries=window_queries,
        window_positions=window_positions,
        stats=dict(stats or {}),
        budget=budget,
    )


def window_observation(
    n: int,
    heads: int = 3,
    group: int = 3,
    dim: int = 16,
    window: int = 8,
    seed: int = 0,
    positions: torch.Tensor | None = None,
) -> LayerObservation:
    """Random keys/values [H, n, D] and `window` random window queries, the last `window` positions of head 0; dense
    positions unless given. (Not `observation`: it draws its own tensors and takes no statistics or budget.)"""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, n, dim, generator=gen)
    values = torch.randn(heads, n, dim, generator=gen)
    queries = torch.randn(window, heads * group, dim, generator=gen)
    if positions is None:
        positions = torch.arange(n).expand(heads, -1)
    return LayerObservation(
        layer_idx=0,
        keys=keys,
        values=values,
        positions=positions,
        scale=dim**-0.5,
        window_queries=queries,
        window_positions=positions[0, -window:].clone(),
    )


def run_causal_stats(policy, keys, values, queries, prefill, layer_idx=0):
    """Feed a causal sequence through `update_stats` as the engine does: one prefill chunk, then one query per step.

    Each step sees the cache of every token so far; the statistics arrive zero-padded for the new entries.
    """
    heads, n, _ = keys.shape
    stats = {name: torch.zeros(heads, 0) for name in policy.stat_names}
    steps = [(0, prefill)] + [(t, t + 1) for t in range(prefill, n)]
    for start, end in steps:
        padded = {name: torch.cat([s, torch.zeros(heads, end - s.shape[1])], dim=1) for name, s in stats.items()}
        obs = observation(
            keys[:, :end], values[:, :end], dense_positions(heads, end), stats=padded, layer_idx=layer_idx
        )
        stats = policy.update_stats(obs, queries[start:end], torch.arange(start, end))
        for name in policy.stat_names:
            assert stats[name].shape == (heads, end)
    return stats


def ahakv_obs(n, heads, group, dim, recent, budget, seed, sparse):
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=seed)
    if sparse:
        positions = sparse_positions(heads, n, 3 * n, recent, seed=seed + 1)
    else:
        positions = dense_positions(heads, n)
    return observation(keys, values, positions, queries[-recent:], positions[0, -recent:].clone(), budget=budget)


def bias_inputs(n, heads, group, dim, trials):
    """`trials` causal inputs (seeds 1000, 1001, ...) for the position-bias measurements of H2O and AhaKV."""
    for trial in range(trials):
        yield causal_inputs(n, heads, group, dim, seed=1000 + trial)


# --------------------------------------------------------------------------------------------------------------------
# Dense references (float64, loops)
# --------------------------------------------------------------------------------------------------------------------


def ref_row(query, keys_h, scale, visible, gain=1.0):
    """One query's softmax attention over one head's keys: exp(gain * q.k * scale) over the visible keys."""
    logits = (keys_h.to(F64) @ query.to(F64)) * scale * gain
    logits = logits.masked_fill(~visible, float("-inf"))
    weights = torch.exp(logits - logits.max())
    return weights / weights.sum()


def ref_attention_sum(keys, queries, positions=None, query_positions=None):
    """H2O's statistic: attention column sums over all queries, causal by position, summed over the group: [H, n]."""
    heads, n, dim = keys.shape
    group = queries.shape[1] // heads
    positions = dense_positions(heads, n) if positions is None else positions
    query_positions = torch.arange(queries.shape[0]) if query_positions is None else query_positions
    total = torch.zeros(heads, n, dtype=F64)
    for h in range(heads):
        for i in range(queries.shape[0]):
            visible = positions[h] <= query_positions[i]
            for g in range(group):
                total[h] += ref_row(queries[i, h * group + g], keys[h], dim**-0.5, visible)
    return total


def ahakv_gain(seen, selected):
    """AhaKV: lambda' = sqrt(2 ln(i / k)) on the scaled logits; i <= k leaves nothing to evict: lambda' = 1."""
    return math.sqrt(2 * math.log(seen / selected)) if seen > selected else 1.0


def ref_window_sums(keys, positions, window_queries, window_positions, gain_for=None):
    """Column sums of the window queries' attention ([H, n]), optionally with a per-row step gain."""
    heads, n, dim = keys.shape
    group = window_queries.shape[1] // heads
    total = torch.zeros(heads, n, dtype=F64)
    for h in range(heads):
        for i in range(window_queries.shape[0]):
            visible = positions[h] <= window_positions[i]
            gain = 1.0 if gain_for is None else gain_for(int(visible.sum()))
            for g in range(group):
                total[h] += ref_row(window_queries[i, h * group + g], keys[h], dim**-0.5, visible, gain)
    return total


def ref_mean_filter(x, kernel, divide_by_kernel=True):
    """Same-size mean filter: entry j averages x[j - k//2 : j + k//2 + 1]; outside the sequence counts as zero."""
    half = kernel // 2
    out = torch.zeros(len(x), dtype=F64)
    for j in range(len(x)):
        part = x[max(0, j - half) : j + half + 1].to(F64)
        out[j] = part.sum() / (kernel if divide_by_kernel else len(part))
    return out


def ref_top(scores, protected, budget):
    """The protected indices plus the highest-scoring others (ties: the earlier index), ascending."""
    protected = sorted(set(protected))
    others = [j for j in range(len(scores)) if j not in protected]
    others.sort(key=lambda j: (-float(scores[j]), j))
    return sorted(protected + others[: budget - len(protected)])


def ref_gamma_bar(values_h, kernel):
    """AhaKV's value prior (Eq. 13-14): mean-filtered ||v||^2 over its maximum."""
    nu = (values_h.to(F64) ** 2).sum(dim=-1)
    gamma = ref_mean_filter(nu, kernel, AHAKV_EDGE_DIVIDES_BY_KERNEL)
    return gamma / gamma.max()


def ref_ahakv_scores(obs, recent, kernel, budget):
    """F_hat = gamma_bar * F with F the step-gain attention of the last B_r queries (Eq. 5, 9-12, 13-15)."""
    selected = budget - recent
    accumulated = ref_window_sums(
        obs.keys,
        obs.positions,
        obs.window_queries,
        obs.window_positions,
        gain_for=lambda seen: ahakv_gain(seen, selected),
    )
    return torch.stack([ref_gamma_bar(obs.values[h], kernel) * accumulated[h] for h in range(obs.num_heads)])


def ref_tova_scores(obs):
    """TOVA: the newest query's attention, averaged over the group's query heads."""
    heads, n, dim = obs.keys.shape
    group = obs.window_queries.shape[1] // heads
    query, position = obs.window_queries[-1], obs.window_positions[-1]
    rows = []
    for h in range(heads):
        visible = obs.positions[h] <= position
        rows.append(sum(ref_row(query[h * group + g], obs.keys[h], dim**-0.5, visible) for g in range(group)) / group)
    return torch.stack(rows)


def as_lists(keep):
    return [row.tolist() for row in keep]
