"""MAT ("MAT: Unlocking KV Cache Efficiency via Managing Anchor Tokens", ACL ARR 2025 submission, OpenReview 0nGPjXF5rH
(no arXiv version)): shallow layers keep sinks + a window; deep layers keep the first token, a window and the
"anchor" tokens, chosen by the LOWEST logit from their own query to the first key (anchors attend to each other
with low logits).

The anchor logit pi_i = q_i . k_0 / sqrt(d), averaged over the query heads of the KV group, is computed once when
token i arrives (a by-product of its attention pass) and kept as a statistic. A deep layer with budget c keeps token
0, the last c - beta entries, and the beta - 1 entries outside that window with the lowest pi (beta = c * fraction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.base import LayerObservation, Policy
from kvserve.policies.knobs import knob


@dataclass(frozen=True, kw_only=True)
class MAT(Policy):
    name = "mat"
    shallow_layers: int = knob(2, "first layers that keep sinks + window (L_s)", minimum=0)
    sink_tokens: int = knob(4, "sinks kept in shallow layers", minimum=1)
    anchor_fraction: float = knob(
        0.25, "beta / budget: share of the budget for anchors in deep layers", minimum=0.0, maximum=1.0
    )
    stat_names = ("anchor_logit",)
    first_logit_mean = "anchor_logit"  # entry 0 is token 0 (always kept)
    pass_statistics = ("first_logits",)

    def protected_tokens(self) -> int:
        return self.sink_tokens

    def anchors(self, budget: int) -> int:
        return max(1, int(budget * self.anchor_fraction))

    def keep_indices(self, obs: LayerObservation, budget: int) -> torch.Tensor:
        n, heads, device = obs.num_tokens, obs.num_heads, obs.positions.device
        if obs.layer_idx < self.shallow_layers:
            sinks, recent = torch.arange(self.sink_tokens), torch.arange(n - (budget - self.sink_tokens), n)
            keep = torch.cat([sinks, recent]).to(device)
            return keep.expand(heads, -1).contiguous()
        beta = self.anchors(budget)
        window_start = n - (budget - beta)
        candidates = obs.stats["anchor_logit"][:, 1:window_start].float()  # entries between token 0 and the window
        anchors = torch.sort(candidates, dim=-1, stable=True).indices[:, : beta - 1] + 1
        window = torch.arange(window_start, n, device=device).expand(heads, -1)
        first = torch.zeros(heads, 1, dtype=torch.long, device=device)
        return torch.sort(torch.cat([first, anchors, window], dim=1), dim=-1).values
