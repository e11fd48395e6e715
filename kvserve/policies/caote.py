"""CAOTE / FastCAOTE ("CAOTE: KV Caching through Attention Output Error based Token Eviction", Goel et al. 2025,
arXiv:2504.14051): turn any base score into the attention-output error of evicting each entry.

With the base scores normalised, h = s / sum(s), and X = sum_i h_i v_i, evicting entry j changes the output by
    c_j = h_j / (1 - h_j) * || X - v_j ||          (CAOTE, Eq. 21)
FastCAOTE replaces X by the mean value. Entries with the smallest c_j are evicted; the base policy's protected
entries stay protected. `<base>+caote` is a subclass of the base made by `caote_variant`, so it keeps the base's
knobs, window and statistics: composition is one rule, not a class per pair. Under GQA the base score is already
one per KV head (the group's query heads summed; normalising makes sum and mean equivalent).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from kvserve.policies.base import LayerObservation, ScoredPolicy

META_SCORES = ("caote", "fastcaote")  # `<base>+<meta>`: the exact error, and the mean-value approximation
MIN_REMAINDER = 1e-6  # a dominant sink can make 1 - h_j ~ 0


def caote_score(base_scores: torch.Tensor, values: torch.Tensor, fast: bool) -> torch.Tensor:
    weights = base_scores.float().clamp(min=0)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    values = values.float()
    output = values.mean(dim=1) if fast else torch.einsum("hn,hnd->hd", weights, values)
    distance = torch.linalg.vector_norm(output[:, None, :] - values, dim=-1)
    return weights / (1 - weights).clamp(min=MIN_REMAINDER) * distance


@cache
def caote_variant(base: type[ScoredPolicy], fast: bool) -> type[ScoredPolicy]:
    suffix = META_SCORES[1] if fast else META_SCORES[0]

    @dataclass(frozen=True, kw_only=True)  # the base's knobs, frozen as the base is
    class CaoteVariant(base):
        name = f"{base.name}+{suffix}"

        def score(self, obs: LayerObservation) -> torch.Tensor:
            return caote_score(super().score(obs), obs.values, fast)

    CaoteVariant.__name__ = CaoteVariant.__qualname__ = f"{base.__name__}{'FastCaote' if fast else 'Caote'}"
    return CaoteVariant
