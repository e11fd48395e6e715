"""The worker's side of prompt checkpoints (`kv_checkpoint`, the engine core's side is `kvserve/core/checkpoints.py`):
a copy of a published checkpoint's lists, and a new request that starts from one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.worker.request import LayerState, WorkerRequest


@dataclass(frozen=True)
class CheckpointLists:
    """The worker's copy of a published checkpoint's lists: what a request that resumes from it starts with."""

    blocks: tuple[int, ...]
    table: np.ndarray
    lens: np.ndarray
    layers: dict[int, LayerState]
    since: int
    compactions: int


def _layer_copy(layer: LayerState) -> LayerState:
    def clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.clone()

    # the window is not carried: the next compaction reads only queries computed after the checkpoint
    return LayerState(
        kept_positions=clone(layer.kept_positions),
        kept_counts=clone(layer.kept_counts),
        stats={name: stat.clone() for name, stat in layer.stats.items()},
        share=clone(layer.share),
        valid=clone(layer.valid),
    )


def lists_of(state: WorkerRequest) -> CheckpointLists | None:
    """The request's lists right after a checkpoint's compaction and block release, if they fill whole blocks (a
    partly filled page would be written by the next append, a free page taken)."""
    pages = state.pages
    if (pages.lens % pages.layout.block_size).any() or not pages.used.all() or pages.protected.any():
        return None
    return CheckpointLists(
        blocks=tuple(pages.blocks),
        table=pages.table.copy(),
        lens=pages.lens.copy(),
        layers={index: _layer_copy(layer) for index, layer in state.layers.items()},
        since=state.since,
        compactions=state.compactions,
    )


def resume_from(state: WorkerRequest, lists: CheckpointLists, block_ids: list[int]) -> None:
    """A fresh request starts from a published checkpoint: its first blocks are the checkpoint's, protected."""
    pages = state.pages
    count = len(lists.blocks)
    if pages.blocks or tuple(block_ids[:count]) != lists.blocks:
        raise RuntimeError("kvserve: a checkpoint's blocks are not the first blocks of the request resuming from it")
    pages.add_blocks(list(lists.blocks))
    pages.used[:] = True
    pages.protected[:] = True
    pages.table = lists.table.copy()
    pages.lens = lists.lens.copy()
    state.layers = {index: _layer_copy(layer) for index, layer in lists.layers.items()}
    state.since = lists.since
    state.compactions = lists.compactions
