"""TOVA ("Transformers are Multi-State RNNs", Oren et al. 2024, arXiv:2401.06104): keep the entries the newest query
attends to most (mean over the group's heads).

The paper drops one token per decode step; kvserve compacts once per block of new tokens, ranking by the newest
query's attention at that moment. `vote_scope=layer` ranks by the mean over all of the layer's query heads and keeps
the same entries in every KV head, as TOVA's own code and kvpress's TOVAPress do: on the parity cases that is what
separated kvserve's TOVA from kvpress's on the default model (docs/benchmarks.md, "Parity with kvpress"). Under
tensor parallelism a rank sees only its heads, so `layer` is refused there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.base import LayerObservation, ScoredPolicy
from kvserve.policies.knobs import knob


@dataclass(frozen=True, kw_only=True)
class TOVA(ScoredPolicy):
    name = "tova"
    pass_statistics = ("window_sums",)
    vote_scope: str = knob(
        "group",
        "whose votes rank a KV head's entries: group (its own query heads) or layer (all of the layer's, the same "
        "entries kept in every KV head, as TOVA's code does)",
        choices=("group", "layer"),
    )

    def window_size(self) -> int:
        return 1

    def score(self, obs: LayerObservation) -> torch.Tensor:
        group = obs.window_queries.shape[1] // obs.num_heads
        votes = obs.window_votes(rows=1) / group  # the newest query's probabilities, mean over the group
        if self.vote_scope == "layer":  # every head then keeps the same positions, so their slots stay aligned
            votes = votes.mean(dim=0, keepdim=True).expand_as(votes).contiguous()
        return votes
