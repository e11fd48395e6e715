"""TOVA (Oren et al., 2024): keep the entries the newest query attends to most (mean over the group's heads).

The paper drops one token per decode step; kvserve compacts once per block of new tokens, ranking by the newest
query's attention at that moment.
"""

from __future__ import annotations

import torch

from kvserve.policies.base import LayerObservation, ScoredPolicy


class TOVA(ScoredPolicy):
    name = "tova"

    def window_size(self) -> int:
        return 1

    def score(self, obs: LayerObservation) -> torch.Tensor:
        return obs.window_attention()[:, :, -1, :].mean(dim=1)
