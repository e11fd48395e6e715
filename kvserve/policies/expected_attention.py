"""Expected Attention ("Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution", Devoto, Jeblick and Jégou 2025, arXiv:2510.00636): score each key by the attention that the next
queries are expected to give it, without seeing them.

The recent queries, taken back to their unrotated form, are modelled as a Gaussian per query head (mean mu,
covariance Sigma). A future query at position t is R_t q, so averaging the rotation over the next `future` positions
gives mean R mu and covariance R Sigma R^T (R the average rotation matrix). For a Gaussian query the expected
exponentiated logit of key k is exp(s k.mu' + s^2 k^T Sigma' k / 2) (s the softmax scale), so the score of k is
that, normalised over the keys (a softmax), averaged over the GQA group and weighted by the value's norm, which
measures how much the entry can move the layer's output. The first `sink_tokens` are kept and take no part.

The statistics come from the last `window` queries only, so the choice does not depend on the rest of the prompt:
a prefix-cache hit that leaves those queries to compute keeps what a miss keeps. Those `window` newest entries are
kept too: the authors' setting compresses a context before the question arrives (kvpress appends the question
uncompressed), and a server sees the question as the prompt's tail. (On the default model this is not what limits
the method: RULER's single needle is 0 of 108 with or without the window, measured in the quality suite.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.base import LayerObservation, ScoredPolicy, recent_mask
from kvserve.policies.knobs import knob


@dataclass(frozen=True, kw_only=True)
class ExpectedAttention(ScoredPolicy):
    name = "expected_attention"
    window: int = knob(
        64, "recent queries whose mean and covariance model the future queries; these tokens are always kept", minimum=2
    )
    future: int = knob(512, "future positions the expected rotation averages over", minimum=1)
    sink_tokens: int = knob(4, "first tokens always kept, left out of the statistics", minimum=0)

    def protected_tokens(self) -> int:
        return self.sink_tokens + self.window

    def window_size(self) -> int:
        return self.window

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        return ((obs.positions >= 0) & (obs.positions < self.sink_tokens)) | recent_mask(obs, self.window)

    def score(self, obs: LayerObservation) -> torch.Tensor:
        mean, covariance = self.future_query_statistics(obs)  # [H, G, D], [H, G, D, D]
        keys = obs.keys.float()
        linear = torch.einsum("hgd,hnd->hgn", mean, keys) * obs.scale
        quadratic = torch.einsum("hnd,hgde,hne->hgn", keys, covariance, keys) * obs.scale**2 / 2
        left_out = (obs.positions < self.sink_tokens)[:, None, :]  # sinks (kept anyway) and a shorter head's padding
        expected = torch.softmax((linear + quadratic).masked_fill(left_out, float("-inf")), dim=-1)
        expected = expected.nan_to_num(0.0)  # a head holding only sinks has nothing to normalise over
        return expected.mean(dim=1) * obs.values.float().norm(dim=-1)

    def future_query_statistics(self, obs: LayerObservation) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean [H, G, D] and covariance [H, G, D, D] of a query at a uniform position among the next `future`,
        from the window's queries (the sinks' queries left out: their activations are outliers)."""
        if obs.rotary is None:
            raise ValueError("expected_attention needs the model's RoPE table, which this layer did not provide")
        assert obs.window_queries is not None and obs.window_positions is not None
        chosen = obs.window_positions >= self.sink_tokens
        if int(chosen.sum()) == 0:  # a prompt no longer than the sinks: use what there is
            chosen = torch.ones_like(chosen)
        positions = obs.window_positions[chosen]
        queries = obs.rotary.unrotate(obs.window_queries[chosen], positions)  # [w, Hq, D]
        count, num_q_heads, dim = queries.shape
        queries = queries.view(count, obs.num_heads, num_q_heads // obs.num_heads, dim)
        mean = queries.mean(dim=0)
        centred = queries - mean
        covariance = torch.einsum("whgd,whge->hgde", centred, centred) / count
        rotation = obs.rotary.mean_matrix(int(positions.max()) + 1, self.future, dim).to(queries.device)
        return mean @ rotation.T, rotation @ covariance @ rotation.T
