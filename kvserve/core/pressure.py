"""When the pool is short of blocks (`kv_evict_when=pressure` requests compact only then)."""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.messages import cdiv


def short_of_blocks(
    free_blocks: int, uncomputed: Iterable[int], running: int, block_size: int, was_short: bool
) -> bool:
    """Whether the pool is short: fewer free blocks (cached ones count, vLLM reuses them) than the requests need for
    their uncomputed tokens (`uncomputed`: the rest of each running request's prompt, or one block for a decoding
    one, and the next waiting request's), with one block to spare per running request. Deferring requests compact
    then, so that the running ones keep growing and the waiting one gets in without a preemption. A compaction frees
    its blocks only after its step, so a pool that `was_short` stays short until it has twice what is needed."""
    need = sum(cdiv(max(tokens, 1), block_size) for tokens in uncomputed)
    return free_blocks < 2 * need if was_short else free_blocks < need + running
