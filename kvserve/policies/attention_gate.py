"""Attention-Gate ("In-context KV-Cache Eviction for LLMs via Attention-Gate", Zeng et al. 2024, arXiv:2410.12876): a
trained gate per layer flags, per prompt token and KV head, whether its K/V is kept.

Unlike the other policies it does not rank entries against a budget: each head keeps what its gate flags, so heads
keep different counts (ragged). The engine stores each head's kept entries at the front of its own page list (one
per layer and KV head), so what a gate evicts is freed (`kvserve/worker/gated.py`). Within the prompt, a flagged-out
token is hidden from every later query at once (Eq. 4/7), while it still sees itself. Decode-time tokens are not
gated (the paper runs the gate in prefill only) and are appended; with a budget B, once a head's cache reaches
B + block_size the head keeps its B most recent entries (a window rule that caps growth).

`tau` is the paper's keep threshold (Eq. 6). The shipped gates are trained at 0.5; a request may raise it to evict
more or lower it to keep more with the same gates (the score-against-keep curve in the benchmarks is drawn that way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.gates.module import GatePast
from kvserve.policies.base import Policy
from kvserve.policies.knobs import knob
from kvserve.policies.rotary import Rotary


@dataclass(frozen=True, kw_only=True)
class AttentionGate(Policy):
    name = "attention_gate"
    ragged = True  # without kv_budget the cache grows by one entry per generated token
    trained = True
    tau: float = knob(
        0.5, "keep a prompt token where sigmoid(gate logit + gamma) > tau (gates trained at 0.5)", minimum=0, maximum=1
    )

    def gate_flags(
        self, gate, queries: torch.Tensor, positions: torch.Tensor, rotary: Rotary, past: GatePast | None
    ) -> tuple[torch.Tensor, GatePast]:
        """Keep flags [H, m] for prompt tokens at `positions` [m] from the layer's post-RoPE queries [m, Hq, D],
        un-rotated with the layer's own RoPE table (the gate reads queries before RoPE)."""
        gate_input = rotary.unrotate(queries, positions).reshape(1, queries.shape[0], -1)
        logits, past = gate(gate_input, past)
        return gate.flags(logits, positions, self.tau)[0].T, past

    @staticmethod
    def ragged_keep(valid: torch.Tensor, cap: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """valid [H, n] -> (keep_indices [H, M], counts [H]): head h's first counts[h] indices are its kept entries,
        ascending; the rest (up to M, the largest count) are ignored.

        Each head keeps its valid entries; with a cap, only the `cap` most recent of them (the window rule)."""
        counts = valid.sum(dim=1)
        if cap is not None:
            rank_from_end = valid.flip(1).cumsum(1).flip(1)  # 1 for a head's newest valid entry, 2 for the next...
            valid = valid & (rank_from_end <= cap)
            counts = counts.clamp(max=cap)
        width = max(int(counts.max()), 1)
        # stable: valid entries first in their cache order, then the invalid ones (a shorter head's padding)
        keep = torch.sort(valid.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]
        return keep, counts
