"""What an evicting request's prefix-cache hit may cover.

vLLM's hit is cut so that the request computes the prompt's last queries its policy reads (`computed_tail`, from
`Policy.prompt_queries_read`), in whole blocks: its statistics then come from the cached keys plus queries it computes
itself, and it keeps what it keeps on a miss. The prompt's compaction copies the pages it keeps out of the cached
blocks into spare blocks past the prompt's in the request's block-table row, so the hit is also cut to what the row
has room to copy out of. A `kv_checkpoint` request's plain hit stops before its first compaction (a checkpoint hit
covers the rest).
"""

from __future__ import annotations

from kvserve.messages import cdiv


def copyable_hit(num_tokens: int, keep: int | None, row_blocks: int, spare_blocks: int, block_size: int) -> int:
    """The longest hit (tokens) whose blocks the prompt's compaction to `keep` entries can copy its kept pages out of,
    in a block-table row of `row_blocks` blocks. A prompt near `max_model_len` leaves the row no room for the copies,
    so it hits only as many blocks as the row can still take (the blocks it computes itself then stop publishing and
    are compacted in place: `kvserve:prefix_publish_fallbacks`). `keep` None: the prompt does not compact."""
    if keep is None:
        return num_tokens
    room = row_blocks - cdiv(num_tokens, block_size)
    copies = cdiv(keep, block_size) + spare_blocks
    return num_tokens if copies <= room else max(room, 0) * block_size


def hit_limit(
    hit: int, num_tokens: int, computed_tail: int, copyable: int, block_size: int, first_compaction: int | None = None
) -> int:
    """The tokens of vLLM's `hit` the request may use: whole blocks, leaving its `computed_tail` to compute, no more
    than `copyable`, and (`kv_checkpoint`) ending where it leaves `computed_tail` before its `first_compaction`."""
    limit = max(min(hit, num_tokens - computed_tail), 0) // block_size * block_size
    limit = min(limit, copyable)
    if first_compaction is not None:  # plain blocks: what a miss holds before its first compaction
        limit = min(limit, max(first_compaction - computed_tail, 0))
        limit = limit // block_size * block_size
    return limit
