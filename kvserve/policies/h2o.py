"""H2O ("H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", Zhang et al. 2023,
arXiv:2306.14048): heavy hitters by attention accumulated over every query so far, plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.base import LayerObservation, ScoredPolicy, recent_mask
from kvserve.policies.knobs import knob


@dataclass(frozen=True, kw_only=True)
class H2O(ScoredPolicy):
    name = "h2o"
    recent: int = knob(32, "most recent tokens always kept", minimum=0)
    stat_names = ("attention_sum",)
    running_sum = "attention_sum"
    pass_statistics = ("column_sums",)

    def protected_tokens(self) -> int:
        return self.recent

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        return recent_mask(obs, self.recent)

    def score(self, obs: LayerObservation) -> torch.Tensor:
        return obs.stats["attention_sum"]
