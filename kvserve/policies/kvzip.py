"""KVzip ("KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", Kim et al., NeurIPS 2025,
arXiv:2505.23416): keep what the model reads when it repeats the document from its own cache.

The document's entries are scored by the model itself: after the document, it is fed "Repeat the previous context
exactly." and then the document again (teacher forcing), and each cached entry scores the most attention any of those
reconstruction queries, in any query head of its KV head's GQA group, gave it: score(k) = max over t, g of
softmax(q_t,g . K / sqrt(D))[k]. An entry nothing needed to rebuild the text is one no question will need either, so
the choice serves every later question: this is the query-agnostic scorer behind `kv_document`, which compresses a
document once and lets every request that starts with it resume from the compressed lists (docs/guide/serving.md,
"Documents"). The softmax is over everything a query sees (the document, the instruction and the copy
so far), as in the paper's definition. A document is reconstructed in pieces of at most 2,048 tokens, as the paper
does, one request each (`kvserve/server/documents.py`, `kvserve/worker/pieces.py`): each piece's queries see the
whole document, and an entry scores its maximum over every piece.

`document` (N > 0) says the prompt's first N tokens are the document and later queries reconstruct it: only those
queries vote, and only the document's entries can be kept (the engine drops the instruction and the copy). With 0,
every query votes and any entry can be kept: the same statistic over the prompt itself. The first `sink_tokens` are
always kept, as the paper's attention sinks.

`kernel_size` (k > 1, kvserve's own, not the paper's) max-pools the scores over the k neighbouring entries, so that
an entry the reconstruction needed keeps its neighbours too: a needle's key could then stay with its value (at 0.875 on
RULER at 4k the per-entry ranking answers many multi-key lookups with a wrong number). 1, the default, is the paper's
per-entry score: at 0.875 a pool of 15 answered more of niah_multikey_1 but less of niah_multikey_3, niah_multiquery,
niah_multivalue and cwe, below the per-entry score over all (docs/benchmarks.md, the RULER-4k table).

Budgets follow the scores, as the paper allots them: by default (`kv_allocation=global`) every (layer, KV head,
token) score is ranked together, as it is (an attention probability means the same in every layer and head, so
nothing is normalised and no head keeps more than its sinks regardless), and the request keeps the best L x H x B;
a compressed document's counts are then rounded to whole pages so that it is published as whole blocks
(`kvserve.policies.allocation.whole_pages`). `kv_allocation=uniform` keeps B in every list instead (what
each allotment keeps against kvpress's KVzipPress: `kvserve eval parity`, docs/benchmarks.md "Parity with kvpress").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvserve.policies.base import LayerObservation, ScoredPolicy, pool_scores
from kvserve.policies.knobs import knob

# the instruction between the document and its copy (the paper's prompt); a chat model then gets its template's end
# of the user turn and start of the reply, so the copy is the assistant's answer, as in the authors' code
REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."


@dataclass(frozen=True, kw_only=True)
class KVzip(ScoredPolicy):
    name = "kvzip"
    document: int = knob(
        0,
        "tokens of the compressed document the request starts with (POST /v1/kvserve/compress answers it)",
        minimum=0,
    )
    sink_tokens: int = knob(4, "first tokens always kept", minimum=0)
    kernel_size: int = knob(
        1, "max pool of the scores over neighbouring entries (odd; 1: the paper's)", minimum=1, odd=True
    )

    stat_names = ("reconstruction",)
    reconstructs: ClassVar[bool] = True
    # single tokens, as the authors select KV pairs; on the default model's multi-key lookup at 1k tokens and B=512,
    # spans of 8 answered 2 of 12 cases and single tokens 4 of 12 (a reconstruction's peaks are per token)
    default_span: ClassVar[int] = 1
    default_allocation: ClassVar[str] = "global"
    comparable_scores: ClassVar[bool] = True

    def protected_tokens(self) -> int:
        return self.sink_tokens

    def prompt_queries_read(self) -> int | None:
        # a document's question never compacts and its reconstruction reads every query past the document, which a
        # plain hit never covers (`kvserve.core.checkpoints.first_compaction`): a hit changes nothing it keeps
        return 0 if self.document else None

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        return (obs.positions >= 0) & (obs.positions < self.sink_tokens)

    def update_stats(
        self, obs: LayerObservation, queries: torch.Tensor, query_positions: torch.Tensor, chunk: int = 512
    ) -> dict[str, torch.Tensor]:
        """Fold the step's reconstruction queries into each entry's running maximum of attention received."""
        stats = dict(obs.stats)
        voting = query_positions >= self.document
        if not bool(voting.any()):
            return stats
        queries, query_positions = queries[voting], query_positions[voting]
        keys = obs.keys.float()
        peak = stats["reconstruction"]
        for start in range(0, queries.shape[0], chunk):  # never the whole [q, n] attention matrix at once
            part = slice(start, start + chunk)
            peak = torch.maximum(peak, _peak_attention(obs, keys, queries[part], query_positions[part]))
        stats["reconstruction"] = peak
        return stats

    def score(self, obs: LayerObservation) -> torch.Tensor:
        scores = obs.stats["reconstruction"].float()
        copy = obs.positions >= self.document if self.document else None
        if self.kernel_size > 1:  # the instruction and the copy lend no score to the document's last entries
            scores = pool_scores(scores if copy is None else scores.masked_fill(copy, 0.0), self.kernel_size, "max")
        if copy is not None:  # the instruction and the copy are never kept: the lists must stand for the document alone
            scores = scores.masked_fill(copy, float("-inf"))
        return scores


def _peak_attention(
    obs: LayerObservation, keys: torch.Tensor, queries: torch.Tensor, query_positions: torch.Tensor
) -> torch.Tensor:
    """[H, n]: the most attention each entry gets from `queries` [q, H*G, D] in any query head of its group, causal
    by position: `obs.attention(...).amax((1, 2))` with the mask applied in place (the reconstruction is twice the
    document long, so this runs over the largest attention matrices kvserve scores)."""
    count, num_q_heads, dim = queries.shape
    grouped = queries.float().reshape(count, obs.num_heads, num_q_heads // obs.num_heads, dim).permute(1, 2, 0, 3)
    logits = torch.einsum("hgqd,hnd->hgqn", grouped, keys).mul_(obs.scale)
    hidden = (obs.positions[:, None, :] > query_positions[None, :, None]) | (obs.positions < 0)[:, None, :]
    logits.masked_fill_(hidden[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1).amax(dim=(1, 2))
