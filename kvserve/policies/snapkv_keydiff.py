"""SnapKV's votes or KeyDiff's diversity, whichever ranks an entry higher: the rule that kept long documents'
needles when the votes come from the question before the document streams in (`kv_lookahead`).

Each head ranks its entries twice: by SnapKV's pooled votes ("SnapKV: LLM Knows What You are Looking for Before
Generation", Li et al. 2024, arXiv:2404.14469) and by KeyDiff's distance from the mean key direction ("KeyDiff: Key
Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments", Park et al.
2025, arXiv:2504.15364). An entry's score is its better percentile rank, so the top of each ranking survives. Why:
while a long prompt streams in, votes cast by the question run alone (`kv_lookahead`) find most needles but not all,
and KeyDiff keeps a different set (docs/benchmarks.md, "What keeps the needle": on Qwen2.5-Coder-0.5B at B=1024 the
mix answered 5 of 5 passkeys at 8k-32k, the votes alone 4 and KeyDiff alone 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.base import LayerObservation, percentile_ranks
from kvserve.policies.keydiff import KeyDiff
from kvserve.policies.knobs import knob
from kvserve.policies.snapkv import SnapKV

DIVERSITY = KeyDiff()  # (its score reads no setting: made once, not per compaction)


@dataclass(frozen=True, kw_only=True)
class SnapKVKeyDiff(SnapKV):
    name = "snapkv_keydiff"
    # the pool every long-prompt result of this mix was measured with (SnapKV's default then; its 31 is untested here)
    kernel_size: int = knob(15, "pooling kernel over keys (odd; SnapKV's paper's is 7)", minimum=1, odd=True)

    def score(self, obs: LayerObservation) -> torch.Tensor:
        votes = super().score(obs)
        diversity = DIVERSITY.score(obs)
        return torch.maximum(percentile_ranks(votes), percentile_ranks(diversity))
