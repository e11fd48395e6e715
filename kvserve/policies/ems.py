"""EMS ("EMS: Adaptive Evict-then-Merge Strategy for Head-wise KV Cache Compression Based on Global-Local Importance",
Li et al. 2024, arXiv:2412.08521): Global-Local scores, then evict-then-merge per head with a zero class.

Score: s_gl = max(s_glo * sum(s_loc) / sum(s_glo), s_loc), mean-pooled, where s_glo accumulates attention over all
queries (as H2O) and s_loc sums the last `window` queries (as SnapKV).
Budget B = N_imp + window, gamma = (B + N_tbm) / B. The window is kept; of the rest, the top N_imp by s_gl are class
centres, the next N_tbm are to-be-merged (TBM), the others are evicted. A TBM token joins the centre maximising
R = cos(k_i, k_d) * cos(v_i, v_d) if R > tau, otherwise it is in the zero class (evicted, never stored).
A centre's entry becomes the s_loc-weighted mean of its members' keys and values (post-RoPE keys: the paper's
"w. pos" variant; one K and one V per centre, a simplification of kvserve's).
During decoding kvserve re-runs the same rule once per block of new tokens, with s_loc from the last `window`
queries; the paper's alternating local windows (effective length window..2*window-1) are not reproduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.policies.base import LayerObservation, Policy, Selection, pool_scores
from kvserve.policies.knobs import knob


@dataclass(frozen=True, kw_only=True)
class EMS(Policy):
    name = "ems"
    window: int = knob(32, "local window: recent queries for s_loc, always kept", minimum=1)
    kernel_size: int = knob(7, "mean pooling of s_gl (odd)", minimum=1, odd=True)
    tau: float = knob(0.6, "merge threshold on R", minimum=0.0, maximum=1.0)
    gamma: float = knob(4.0, "(B + N_tbm) / B: how many tokens are considered for merging", minimum=1.0)
    stat_names = ("attention_sum",)
    running_sum = "attention_sum"
    pass_statistics = ("column_sums", "window_sums")

    def protected_tokens(self) -> int:
        return self.window

    def window_size(self) -> int:
        return self.window

    def global_local(self, obs: LayerObservation) -> tuple[torch.Tensor, torch.Tensor]:
        s_glo = obs.stats["attention_sum"].float()
        s_loc = obs.window_votes()
        aligned = s_glo * s_loc.sum(-1, keepdim=True) / s_glo.sum(-1, keepdim=True).clamp(min=1e-30)
        return pool_scores(torch.maximum(aligned, s_loc), self.kernel_size), s_loc

    def keep_indices(self, obs: LayerObservation, budget: int) -> torch.Tensor:
        return self.select(obs, budget).keep_indices

    def select(self, obs: LayerObservation, budget: int) -> Selection:
        n = obs.num_tokens
        s_gl, s_loc = self.global_local(obs)
        split = n - self.window
        n_imp = budget - self.window
        n_tbm = min(int(round((self.gamma - 1) * budget)), split - n_imp)
        order = torch.sort(s_gl[:, :split], dim=-1, descending=True, stable=True).indices
        keys, values = obs.keys.float(), obs.values.float()
        window = torch.arange(split, n, device=order.device)
        keep_rows, key_rows, value_rows, stat_rows = [], [], [], []
        for h in range(obs.num_heads):
            centres, tbm = order[h, :n_imp], order[h, n_imp : n_imp + n_tbm]
            weight = s_loc[h].clamp(min=1e-12)
            k_sum = keys[h, centres] * weight[centres, None]
            v_sum = values[h, centres] * weight[centres, None]
            w_sum = weight[centres].clone()
            glo = obs.stats["attention_sum"][h, centres].float().clone()
            if n_tbm and n_imp:
                similarity = (F.normalize(keys[h, tbm], dim=-1) @ F.normalize(keys[h, centres], dim=-1).T) * (
                    F.normalize(values[h, tbm], dim=-1) @ F.normalize(values[h, centres], dim=-1).T
                )
                best, target = similarity.max(dim=-1)
                merged = best > self.tau  # the rest is the zero class: evicted
                members, target = tbm[merged], target[merged]
                k_sum.index_add_(0, target, keys[h, members] * weight[members, None])
                v_sum.index_add_(0, target, values[h, members] * weight[members, None])
                w_sum.index_add_(0, target, weight[members])
                glo.index_add_(0, target, obs.stats["attention_sum"][h, members].float())
            kept = torch.cat([centres, window])
            ordered = torch.argsort(kept)
            keep_rows.append(kept[ordered])
            key_rows.append(torch.cat([k_sum / w_sum[:, None], keys[h, window]])[ordered])
            value_rows.append(torch.cat([v_sum / w_sum[:, None], values[h, window]])[ordered])
            stat_rows.append(torch.cat([glo, obs.stats["attention_sum"][h, window].float()])[ordered])
        return Selection(
            torch.stack(keep_rows),
            torch.stack(key_rows),
            torch.stack(value_rows),
            {"attention_sum": torch.stack(stat_rows)},
        )
