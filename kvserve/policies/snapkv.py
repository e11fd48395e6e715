"""SnapKV ("SnapKV: LLM Knows What You are Looking for Before Generation", Li et al. 2024, arXiv:2404.14469):
the last `window` queries vote for the keys they attend to.

Per KV head, the window queries' attention probabilities are summed over the window and over the query heads of the
GQA group, smoothed with a 1-D pool over the keys before the window, and the top (budget - window) keys are kept
together with the window itself.

The pool is the paper's way to keep "the complete information" around what the window attends to. Its kernel is
31 by default, where the paper pools over 7 (`kv_kernel_size=7` serves the paper's): what must stay whole is longer
in some prompts. A 7-digit value tokenized digit by digit sits 8 entries past the key a question attends to, and a
36-character UUID many more; a narrow pool keeps the key and lets the value's tail go (the answer then starts right
and goes wrong). Measured (docs/benchmarks.md): on RULER at 4k with the question inside, 31 kept more of full's
score than 15 at ratios 0.75 and 0.875 (section "On kvpress's leaderboard: RULER at 4k"); on the own suite it kept
as much as 15 at every budget and more at the smallest (section "How much quality do I keep at 8x?", the pool
settings side by side). The default is the class's, so the server default, `--kv-policy snapkv`, a request naming
snapkv and `vllm serve` all pool over 31.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.base import LayerObservation, ScoredPolicy, pool_scores, recent_mask
from kvserve.policies.knobs import knob


@dataclass(frozen=True, kw_only=True)
class SnapKV(ScoredPolicy):
    name = "snapkv"
    window: int = knob(32, "observation window: most recent queries that vote, always kept", minimum=1)
    kernel_size: int = knob(31, "pooling kernel over keys (odd; the paper's is 7)", minimum=1, odd=True)
    pooling: str = knob("avg", "pooling of the votes", choices=("avg", "max"))

    pass_statistics = ("window_sums",)

    def protected_tokens(self) -> int:
        return self.window

    def window_size(self) -> int:
        return self.window

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        return recent_mask(obs, self.window)

    def score(self, obs: LayerObservation) -> torch.Tensor:
        votes = obs.window_votes()  # [H, n]
        window = self.protected_mask(obs)
        # Pool over each head's prefix only (as SnapKV does), so the window's own large self-attention does not leak
        # into the scores of the keys just before it. Heads holding fewer entries than others (padded) have their
        # window earlier: zeroing window and padding before the pool gives each head what pooling its own prefix alone
        # gives (the pool pads with zeros, and votes are never negative).
        padding = obs.padding()
        outside = window if padding is None else window | padding
        pooled = pool_scores(votes.masked_fill(outside, 0), self.kernel_size, self.pooling)
        return torch.where(window, votes, pooled)
