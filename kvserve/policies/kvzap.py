"""KVzap ("KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", Jegou et al. 2026, arXiv:2601.07891): KVzip's
choice without KVzip's second pass over the context.

KVzip ("KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv:2505.23416) scores an entry by
the attention it gets while the model repeats its context, which costs a second prefill and only works on a prefix
compressed as a whole. KVzap trains, per model and layer, a small surrogate (linear, or one hidden layer) that
predicts each KV head's log KVzip+ score of a token from the layer's view of that token alone (here its queries
before RoPE, a linear image of the normalised hidden states the paper reads). So every entry is scored once, as it
is written, in every prefill chunk and decode step; the score is kept beside the entry and moves with it.

Two ways to keep, per (layer, KV head) list, the `window` newest entries always (the paper's sliding window):
- a budget B (`kv_budget`): the B best by predicted score, as kvpress's `KVzapPress` under a compression ratio;
- a threshold T (`kv_threshold`): an older entry stays only if its predicted log score is at least T (kvpress's
  `ThresholdPress`), so each head keeps what its content needs; B still caps every list, so memory stays bounded.

Scores are exp(predicted log score), a predicted attention share that means the same in every layer and head (as
KVzip's does), so `kv_allocation=global` ranks them as they are and CAOTE can weigh them. The surrogate file of the
served model: `kvserve.kvzap.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvserve.policies.base import LayerObservation, ScoredPolicy, Selection, recent_mask, written_newest
from kvserve.policies.knobs import knob
from kvserve.policies.rotary import Rotary

STAT = "kvzap"  # per entry: the surrogate's predicted log KVzip+ score, written when the entry is


@dataclass(frozen=True, kw_only=True)
class KVzap(ScoredPolicy):
    name = "kvzap"
    window: int = knob(128, "newest entries always kept (the paper's sliding window)", minimum=0)
    threshold: float | None = knob(
        None, "keep an older entry only if its predicted log KVzip+ score is at least this (none: the B best)"
    )

    stat_names = (STAT,)
    token_statistics: ClassVar[bool] = True  # the score is the token's own
    trained: ClassVar[bool] = True
    default_span: ClassVar[int] = 1  # a token's own prediction, as the paper prunes
    comparable_scores: ClassVar[bool] = True

    def decides_counts(self) -> bool:
        return self.threshold is not None

    def protected_tokens(self) -> int:
        return self.window

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        return recent_mask(obs, self.window)

    def token_scores(
        self, layer_idx: int, queries: torch.Tensor, query_positions: torch.Tensor, rotary: Rotary | None, model: str,
        heads: slice,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """The layer's surrogate over the step's queries [q, Hq, D], un-rotated: each new entry's log score [H, q]."""
        from kvserve.kvzap.registry import surrogates_for

        if rotary is None:
            raise ValueError("kvzap reads queries before RoPE; this layer's rotary embedding is unknown")
        return {STAT: surrogates_for(model).scores_of_rotated(layer_idx, queries, query_positions, rotary)[heads]}

    def update_stats(
        self, obs: LayerObservation, queries: torch.Tensor, query_positions: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The step's queries score the step's q new entries, the newest of each head's list."""
        scores = self.token_scores(obs.layer_idx, queries, query_positions, obs.rotary, obs.model, obs.heads)
        predicted = scores[STAT]
        stat = written_newest(obs.stats[STAT], predicted.to(obs.stats[STAT].dtype), obs.lengths, obs.num_tokens)
        return {**obs.stats, STAT: stat}

    def score(self, obs: LayerObservation) -> torch.Tensor:
        return obs.stats[STAT].float().exp()

    def head_counts(self, obs: LayerObservation, budget: int) -> torch.Tensor:
        """[H] with a threshold: the protected entries and those scoring at least T, at most `budget`."""
        passing = (obs.stats[STAT] >= self.threshold) | self.protected_mask(obs)
        padding = obs.padding()
        if padding is not None:
            passing &= ~padding
        return passing.sum(dim=1).clamp(max=budget)

    def select(self, obs: LayerObservation, budget: int) -> Selection:
        return super().select(obs, budget) if self.threshold is None else self.select_head_counts(obs, budget)
