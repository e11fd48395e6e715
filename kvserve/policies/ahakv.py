"""AhaKV ("AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction for Efficient Inference of Large Language
Models", Gu et al. 2025, arXiv:2506.03762): accumulated attention without H2O's position bias, plus a value-norm prior.

1. Recent accumulation: only the last `recent` queries' rows are summed, so every key gets the same number of terms.
2. Step-gain softmax: those rows use logits sharpened by lambda' = sqrt(2 ln(i / k)) (i = keys the row sees,
   k = budget - recent), which makes a row's expected entropy that of a uniform distribution over the budget.
   The model's own attention is untouched; only the score uses it.
3. Value prior: gamma = mean filter of ||v||^2, normalised by its maximum; the score is gamma_bar * F.
Keeps the `recent` newest entries plus the top (budget - recent) by that score (no sinks, as in the paper).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.policies.base import LayerObservation, ScoredPolicy, pool_scores, recent_mask
from kvserve.policies.knobs import knob


@dataclass(frozen=True, kw_only=True)
class AhaKV(ScoredPolicy):
    name = "ahakv"
    recent: int = knob(32, "recent queries accumulated (B_r); these tokens are always kept", minimum=1)
    kernel_size: int = knob(7, "mean filter over value norms (odd)", minimum=1, odd=True)

    pass_statistics = ("window_sums",)

    def protected_tokens(self) -> int:
        return self.recent

    def window_size(self) -> int:
        return self.recent

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        return recent_mask(obs, self.recent)

    def step_gain(self, obs: LayerObservation) -> torch.Tensor:
        """lambda' per head and window row: [H, 1, w, 1]."""
        keep = max(obs.budget - self.recent, 1)
        seen = (obs.positions[:, None, :] <= obs.window_positions[None, :, None]).sum(-1).float()  # [H, w]
        ratio = seen / keep
        gain = torch.where(ratio > 1, torch.sqrt(2 * torch.log(ratio.clamp(min=1.0))), torch.ones_like(ratio))
        return gain[:, None, :, None]

    def window_logit_scale(self, obs: LayerObservation) -> torch.Tensor:
        return self.step_gain(obs)[:, 0, :, 0]

    def score(self, obs: LayerObservation) -> torch.Tensor:
        accumulated = obs.window_votes(self.step_gain(obs))
        norms = obs.values.float().pow(2).sum(-1)  # [H, n]
        smooth = pool_scores(norms, self.kernel_size)  # kvserve's reading: SnapKV's pooling, zero "same" padding
        prior = smooth / smooth.amax(dim=-1, keepdim=True).clamp(min=math.ulp(1.0))
        return prior * accumulated
