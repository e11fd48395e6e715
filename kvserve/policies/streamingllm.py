"""StreamingLLM ("Efficient Streaming Language Models with Attention Sinks", Xiao et al. 2023, arXiv:2309.17453):
attention sinks plus a recent window. No scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.base import LayerObservation, Policy
from kvserve.policies.knobs import knob


@dataclass(frozen=True, kw_only=True)
class StreamingLLM(Policy):
    name = "streamingllm"
    sink_tokens: int = knob(4, "first tokens always kept (attention sinks)", minimum=0)

    def protected_tokens(self) -> int:
        return self.sink_tokens

    def keep_indices(self, obs: LayerObservation, budget: int) -> torch.Tensor:
        recent = budget - self.sink_tokens
        if obs.lengths is None:
            n = obs.num_tokens
            keep = torch.cat([torch.arange(self.sink_tokens), torch.arange(n - recent, n)])
            return keep.to(obs.keys.device).expand(obs.num_heads, budget).contiguous()
        # heads of different lengths: each keeps its own sinks and last entries (all of them when shorter than B)
        slots = torch.arange(budget, device=obs.keys.device)[None, :]
        lengths = obs.lengths.to(obs.keys.device)[:, None]
        recent_start = (lengths - recent).clamp(min=self.sink_tokens)
        keep = torch.where(slots < self.sink_tokens, slots, recent_start + slots - self.sink_tokens)
        return torch.where(lengths <= budget, slots, keep)
