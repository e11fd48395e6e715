"""TOVA ("Transformers are Multi-State RNNs", Oren et al. 2024, arXiv:2401.06104): keep the entries the newest query
attends to most (mean over the group's heads).

The paper drops one token per decode step; kvserve compacts once per block of new tokens, ranking by the newest
query's attention at that moment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.base import LayerObservation, ScoredPolicy


@dataclass(frozen=True, kw_only=True)
class TOVA(ScoredPolicy):
    name = "tova"
    pass_statistics = ("window_sums",)

    def window_size(self) -> int:
        return 1

    def score(self, obs: LayerObservation) -> torch.Tensor:
        group = obs.window_queries.shape[1] // obs.num_heads
        return obs.window_votes(rows=1) / group  # the newest query's probabilities, mean over the group
