"""KeyDiff ("KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained
Environments", Park et al. 2025, arXiv:2504.15364): keep the keys least like the others.

Per KV head, the anchor is the mean direction of the cached keys (the mean of their unit vectors) and each entry
scores minus its key's cosine similarity to it: keys that point where most keys point add little that the others
do not, and distinctive keys are the ones attention can single out. No query takes part, so the choice is the same
whatever question follows: what a prompt checkpoint (`kv_checkpoint`), compacting the prompt before the question
arrives, needs. The paper compacts block by block as the prompt streams in, which is what checkpoints do.

The `window` newest entries are kept besides: a server sees the question as the prompt's tail (KeyDiff's own setting
compresses the context alone), and without them the question's own tokens would compete with the document's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.policies.base import LayerObservation, ScoredPolicy, recent_mask
from kvserve.policies.knobs import knob


@dataclass(frozen=True, kw_only=True)
class KeyDiff(ScoredPolicy):
    name = "keydiff"
    window: int = knob(32, "newest entries always kept (the question's tail)", minimum=0)

    def protected_tokens(self) -> int:
        return self.window

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        return recent_mask(obs, self.window)

    def score(self, obs: LayerObservation) -> torch.Tensor:
        directions = F.normalize(obs.keys.float(), dim=-1)  # [H, n, D]
        real = (obs.positions >= 0).unsqueeze(-1)  # a shorter head's padding is not part of its anchor
        anchor = (directions * real).sum(dim=1) / real.sum(dim=1).clamp(min=1)  # [H, D]
        return -F.cosine_similarity(directions, anchor[:, None, :], dim=-1)
