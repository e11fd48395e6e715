"""DuoAttention ("DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads", Xiao et al.
2024, arXiv:2410.10819): a few KV heads retrieve from the whole context, the others only attend to the attention
sinks and the newest tokens, so their entries in between can go.

Which heads retrieve is trained once per model (`kvserve/tools/training/roles.py`: a gate per KV head mixing full and
streaming attention, the model frozen, distilled on synthetic retrieval data with an L1 penalty on the gates); the
shipped roles file (`kvserve/duo/roles/<model>.json`) holds the gates, and a request's `retrieval_fraction` f makes the
f x L x H heads with the largest gates retrieval heads. Here a head's pages are really freed, per (layer, KV head).

Counts, at equal memory: `kv_budget` B is the average per (layer, KV head), as for every allocation. A streaming head
keeps `sink_tokens` + `recent` entries (the first and the newest tokens); the retrieval heads share the rest of the
model's L x H x B equally, so each keeps (L x H x B - streaming heads x (sink_tokens + recent)) / retrieval heads,
choosing by SnapKV's window votes (the paper's "composed" setting) when that is below what it holds. A budget of
`max_model_len` lets retrieval heads keep every entry, the paper's plain form. During decoding each list returns to
its count once a block of new tokens arrived. A compressed document (`kv_document`) rounds the counts to whole pages
(`kvserve/worker/allocated.py`), so that it is published as whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvserve.duo.roles import roles_for
from kvserve.policies.base import LayerObservation, Selection, recent_mask
from kvserve.policies.knobs import knob
from kvserve.policies.snapkv import SnapKV


@dataclass(frozen=True, kw_only=True)
class DuoAttention(SnapKV):
    name = "duoattention"
    own_counts: ClassVar[bool] = True
    fixed_counts: ClassVar[bool] = True
    trained: ClassVar[bool] = True
    # the retrieval heads' pool as every DuoAttention result was measured (SnapKV's was 7 then; its 15 is untested here)
    kernel_size: int = knob(7, "pooling kernel over keys (odd)", minimum=1, odd=True)
    # 0.25 rather than 0.5 by the quality suite (measured: docs/benchmarks.md, section "How much quality do I keep at
    # 8x?"): at small budgets fewer retrieval heads with larger shares keep more
    retrieval_fraction: float = knob(
        0.25, "share of KV heads (largest trained gates) that retrieve", minimum=0.0, maximum=1.0
    )
    sink_tokens: int = knob(16, "a streaming head's first tokens (the roles were trained with 16)", minimum=0)
    recent: int = knob(64, "a streaming head's newest tokens (the roles were trained with 64)", minimum=1)

    def protected_tokens(self) -> int:
        return max(self.window, self.sink_tokens + self.recent)

    def prompt_queries_read(self) -> int | None:
        return None  # its counts differ by head, decided before any score: kept out of shared prefix blocks for now

    def retrieval_heads(self, obs: LayerObservation) -> torch.Tensor:
        """[H] bool: this layer's retrieval heads (this rank's, under tensor parallelism: the roles rank all heads)."""
        retrieval = roles_for(obs.model, obs.total_heads).retrieval(self.retrieval_fraction)
        if obs.layer_idx >= retrieval.shape[0]:
            raise ValueError(
                f"the DuoAttention roles of {obs.model!r} have {retrieval.shape[0]} layers, not layer {obs.layer_idx}"
            )
        return retrieval[obs.layer_idx, obs.heads].to(obs.positions.device)

    def head_counts(self, obs: LayerObservation, budget: int) -> torch.Tensor:
        """[H] entries each head keeps: sinks + recent for a streaming head, the retrieval heads' equal share of the
        model's L x H x B for a retrieval head; never more than a head holds."""
        roles = roles_for(obs.model, obs.total_heads)
        total_heads = roles.gates.numel()  # layers x KV heads of the whole model
        retrieval = int(roles.retrieval(self.retrieval_fraction).sum())
        streaming_count = self.sink_tokens + self.recent
        retrieval_count = (total_heads * budget - (total_heads - retrieval) * streaming_count) // max(retrieval, 1)
        counts = torch.where(self.retrieval_heads(obs), retrieval_count, streaming_count)
        held = obs.lengths if obs.lengths is not None else torch.full_like(counts, obs.num_tokens)
        return torch.minimum(counts, held.to(counts.device)).clamp(min=0)

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        """A retrieval head protects SnapKV's window; a streaming head its sinks and its `recent` newest entries
        (with its count, exactly what it keeps)."""
        window = super().protected_mask(obs)
        streaming = (obs.positions >= 0) & (obs.positions < self.sink_tokens)
        streaming |= recent_mask(obs, self.recent)
        return torch.where(self.retrieval_heads(obs)[:, None], window, streaming)

    def select(self, obs: LayerObservation, budget: int) -> Selection:
        return self.select_head_counts(obs, budget)
