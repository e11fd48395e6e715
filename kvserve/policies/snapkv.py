"""SnapKV (Li et al., 2024): the last `window` queries vote for the keys they attend to.

Per KV head, the window queries' attention probabilities are summed over the window and over the query heads of the
GQA group, smoothed with a 1-D pool over the keys before the window, and the top (budget - window) keys are kept
together with the window itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.policies.base import Knob, LayerObservation, ScoredPolicy


class SnapKV(ScoredPolicy):
    name = "snapkv"
    knobs = {
        "window": Knob(int, 32, "observation window: most recent queries that vote, always kept", minimum=1),
        "kernel_size": Knob(int, 7, "pooling kernel over keys (odd)", minimum=1, odd=True),
        "pooling": Knob(str, "avg", "pooling of the votes", choices=("avg", "max")),
    }

    def protected_tokens(self) -> int:
        return self.window

    def window_size(self) -> int:
        return self.window

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        mask = torch.zeros(obs.num_heads, obs.num_tokens, dtype=torch.bool, device=obs.keys.device)
        mask[:, obs.num_tokens - self.window :] = True
        return mask

    def score(self, obs: LayerObservation) -> torch.Tensor:
        votes = obs.window_attention().sum(dim=(1, 2))  # [H, n]
        prefix = votes[:, : obs.num_tokens - self.window]
        # Pool over the prefix only (as SnapKV does), so the window's own large self-attention does not leak into
        # the scores of the keys just before it.
        pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
        pooled = pool(prefix[:, None, :], self.kernel_size, stride=1, padding=self.kernel_size // 2)[:, 0, :]
        return torch.cat([pooled, votes[:, obs.num_tokens - self.window :]], dim=-1)
