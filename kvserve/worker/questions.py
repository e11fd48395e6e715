"""The question's queries of `kv_lookahead` requests, between the request that records them and the one that reads them.

`kvserve/server/lookahead.py` serves a `kv_lookahead=T` request as two engine requests: first the prompt's last T
tokens alone (the probe, `kv_question_probe`), whose every layer's queries this worker keeps here, then the request
itself (`kv_question`), whose prefill chunks are compacted by those queries' votes (`kvserve/worker/eviction.py`).
The probe runs at positions 0 .. T-1, so its queries are kept unrotated and rotated to the question's own positions
where they are read: RoPE makes attention depend on relative positions only, so the tail run alone at 0 has the same
queries as at its place in the prompt. The store is a `KeyedLayers` (kvserve/worker/keyed.py).
"""

from __future__ import annotations

import torch

from kvserve.policies import LayerObservation
from kvserve.worker.request import LayerState
from kvserve.worker.step import RowPlan


def keep_question(plan: RowPlan, layer: LayerState, layer_idx: int, window: int) -> None:
    """A kv_lookahead probe (the prompt's last `window` tokens alone, at positions 0 ..): once its prompt is
    computed, the layer's queries go to the question's store unrotated (`kvserve/worker/questions.py`)."""
    if plan.logical_len != window:  # its prompt is not whole yet (a chunk), or a decode step past it
        return
    rotary = plan.state.rotary.get(layer_idx)
    if rotary is None:
        raise RuntimeError("kv_lookahead needs the layer's RoPE table, and this layer has none")
    plan.state.question[layer_idx] = rotary.unrotate(layer.window.queries(), layer.window.positions())


def question_window(plan: RowPlan, layer_idx: int, obs: LayerObservation) -> tuple[torch.Tensor, torch.Tensor] | None:
    """kv_lookahead: at a compaction inside the prompt, the question's queries [T, Hq, D] rotated to their positions
    (the prompt's last T) and those positions; None where the request's own window votes (decode, or no question)."""
    config = plan.state.config
    if not config.question or plan.compaction is None:
        return None
    stored = plan.state.question.get(layer_idx)
    if stored is None:
        raise RuntimeError(f"kv_lookahead: the question's queries of layer {layer_idx} were not recorded")
    positions = torch.arange(config.question_start, config.question_start + stored.shape[0])
    if plan.logical_len > int(positions[-1]) + 1:  # past the prompt: decode compactions vote with their own window
        return None
    if obs.rotary is None:
        raise RuntimeError("kv_lookahead needs the layer's RoPE table, and this layer has none")
    return obs.rotary.rotate(stored, positions), positions.to(obs.positions.device)
