"""A document reconstructed piece by piece (KVzip's chunked reconstruction, arXiv:2505.23416 section 3.2): the
scores of each piece's request meet here, and the piece that ends the document compacts with all of them.

A document and its whole copy take twice the document's length, so a document over half of `max_model_len` could not
be reconstructed in one request. `POST /v1/kvserve/compress` (kvserve/server/documents.py) then sends one request per
piece of the copy, one after another: the document, an instruction (for a later piece: "repeat the part ... starting
with" the previous piece's last tokens) and that piece. Each scores the document's entries with its own
reconstruction queries (KVzip's running maximum of the attention an entry received, `update_stats`); an earlier
piece folds its scores into the entry under the pieces' key after every step, and the last piece, before it
compacts, takes the maximum of its own and the entry's: every entry then scores the most attention any
reconstruction query of any piece gave it, as in the one-request reconstruction, where each query saw the whole
document too. Only the last piece compacts and publishes; the earlier ones are plain requests that also publish the
document's blocks, which the later pieces then read instead of recomputing.
"""

from __future__ import annotations

import torch

from kvserve.worker.request import LayerState
from kvserve.worker.step import RowPlan


def meet_pieces(plan: RowPlan, layer: LayerState, layer_idx: int) -> dict[str, torch.Tensor] | None:
    """After the step's statistics: an earlier piece folds its document scores into the entry; the last piece at its
    compaction returns its statistics with every piece's scores folded in (None otherwise)."""
    pieces = plan.state.pieces
    if pieces is None:
        return None
    document = plan.state.config.document
    if any(stat.shape[1] < document for stat in layer.stats.values()):
        return None  # the document is still being computed: no reconstruction query has voted yet
    own = {name: stat[:, :document] for name, stat in layer.stats.items()}
    stored = pieces.get(layer_idx)
    if plan.state.config.compresses_document:
        if plan.compaction is None:
            return None
        if stored is None:
            raise RuntimeError(f"the document's earlier pieces left no scores for layer {layer_idx}")
        # KVzip's statistic is a running maximum: the pieces' maxima meet in their maximum
        merged = {name: torch.maximum(stat, stored.to(stat)) for name, stat in own.items()}
        return {name: torch.cat([merged[name], stat[:, document:]], dim=1) for name, stat in layer.stats.items()}
    (stat,) = own.values()
    pieces[layer_idx] = stat.clone() if stored is None else torch.maximum(stored, stat)
    return None
