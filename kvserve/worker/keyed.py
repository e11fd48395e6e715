"""Tensors per layer that one request leaves for another on this worker, by a key both were given: a question's
queries (`kv_lookahead`, kvserve/worker/questions.py) and a document's reconstruction scores piece by piece
(kvserve/worker/pieces.py). Under tensor parallelism every rank keeps its own heads', under pipeline parallelism
every stage its own layers'.

An entry lives until the request that reads it finishes. The store is bounded: a request that never arrives (its
client went away between the two) leaves an entry that newer ones push out.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

LayerTensors = dict[int, torch.Tensor]  # page-view layer -> a tensor


class KeyedLayers:
    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._by_key: OrderedDict[str, LayerTensors] = OrderedDict()

    def recording(self, key: str) -> LayerTensors:
        """A new, empty entry under `key` (replacing any), which its request fills layer by layer."""
        entry = self._by_key[key] = {}
        while len(self._by_key) > self.capacity:
            self._by_key.popitem(last=False)
        return entry

    def get(self, key: str) -> LayerTensors | None:
        return self._by_key.get(key)

    def drop(self, key: str) -> None:
        self._by_key.pop(key, None)

    def __len__(self) -> int:
        return len(self._by_key)
