"""Chat turns (`kv_checkpoint=turns`): where a conversation's turns end, and where a request that computes it from
nothing compacts.

A turn ends right after the chat template's generation prompt (`kvserve.model_support.generation_marker`:
`<|im_start|>assistant\n` here), which every chat prompt ends with and a later turn's prompt holds where the earlier
turn's prompt ended. There the window of queries is the user's question, as at an eager request's prompt end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def marker_ends(tokens: Sequence[int], marker: tuple[int, ...], limit: int) -> list[int]:
    """Positions p <= limit where tokens[p - len(marker) : p] is the marker."""
    array = np.asarray(tokens[:limit], dtype=np.int64)
    size = len(marker)
    starts = np.flatnonzero(array[: max(len(array) - size + 1, 0)] == marker[0])
    return [int(s) + size for s in starts if tuple(array[s : s + size]) == marker]


class TurnEnds:
    """Where one request's chat turns end, in order. A sequence grows only while it decodes, so the list is scanned
    once per token count (admission attempts, chunk stops and the rules all read it), and not again once a turn has
    ended: tokens are only appended, so the first end found stays the first."""

    def __init__(self, marker: tuple[int, ...]) -> None:
        self.marker = marker
        self._count = -1  # the token count the list was scanned at
        self._ends: list[int] = []

    def all(self, tokens: Sequence[int], count: int) -> list[int]:
        """Every turn end among the first `count` tokens."""
        if count != self._count:
            self._ends = marker_ends(tokens, self.marker, count)
            self._count = count
        return self._ends

    def at(self, tokens: Sequence[int], position: int) -> bool:
        """Whether a turn ends exactly at `position`."""
        size = len(self.marker)
        return position >= size and tuple(tokens[position - size : position]) == self.marker

    def ended_before(self, tokens: Sequence[int], count: int, position: int) -> bool:
        """Whether a turn ended before `position` (from then on the decode rule applies to every token)."""
        ends = self._ends or self.all(tokens, count)
        return bool(ends) and ends[0] < position


def turn_positions(ends: list[int], budget: int, block_size: int, limit: int) -> list[int]:
    """Where a `kv_checkpoint=turns` request that starts from nothing compacts, up to `limit` tokens: at each turn's
    end (once its lists exceed B), and after the first one wherever its lists reach B + block size (the decode rule,
    which a reply followed when it was generated). `kvserve.core.compaction.entries_to_keep` is this rule step by
    step; a request that compacted at a prompt end that is no turn's end publishes nothing after it."""
    positions: list[int] = []
    position, cached, armed, index = 0, 0, False, 0
    while True:
        next_marker = ends[index] if index < len(ends) else None
        next_chain = position + budget + block_size - cached if armed else None
        candidates = [p for p in (next_marker, next_chain) if p is not None]
        if not candidates or min(candidates) > limit:
            return positions
        step = min(candidates)
        cached += step - position
        position = step
        if step == next_marker:
            index += 1
            armed = True
            if cached > budget:
                positions.append(step)
                cached = budget
        else:
            positions.append(step)
            cached = budget
