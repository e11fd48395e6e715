"""Prompt checkpoints (`kv_checkpoint`): compacted prefixes that enter the prefix cache.

A request with `kv_checkpoint=C` also compacts its prompt at every multiple of C tokens (the scheduler ends its
chunks there), so its lists at position jC are a function of the first jC tokens and its settings alone, whoever
computes them. A checkpoint whose lists fill whole blocks is published: its blocks get block hashes of their own
(`checkpoint_key` of the prompt's block hash at jC and the settings, then one per block) and stay in vLLM's pool
as cached blocks when the request moves on, for vLLM to reuse or evict like any other; the worker keeps what the
lists are (pages, lengths, kept positions) beside them. A later request whose prompt starts with the same jC tokens
and asks for the same settings starts from those blocks at position jC instead of recomputing the prefix, which is
what a miss would have computed: every compaction up to jC is the same, and its next one reads only queries it
computes itself (a hit leaves at least the policy's window to compute, and C is at least that window).

The published blocks are protected like prefix-cache blocks: the request's next compaction copies the pages it
writes out of them first (`relocate_protected`), and appends always take pages of other blocks (whole blocks hold no
free slot). Hits on checkpoints are counted by vLLM's prefix-cache counters like any hit.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvserve.config import KVConfig
from kvserve.core.record import CoreRequest, Progress
from kvserve.core.turns import turn_positions
from kvserve.messages import CheckpointId, PageReport

logger = logging.getLogger(__name__)


def checkpoint_key(prefix_block_hash: bytes, config: KVConfig) -> bytes:
    """The key of the lists after the prompt's first jC tokens (`prefix_block_hash`: vLLM's chained hash of the block
    ending at jC, which covers the tokens, the cache salt and any extra keys) under these eviction settings."""
    return hashlib.sha256(b"kvserve-checkpoint\0" + prefix_block_hash + repr(config).encode()).digest()


def block_key(key: bytes, index: int) -> bytes:
    """The block hash of a checkpoint's `index`-th block (vLLM's cache maps it to the block like any block hash)."""
    return hashlib.sha256(key + index.to_bytes(4, "big")).digest()


def first_compacting_checkpoint(config: KVConfig) -> int:
    """The first multiple of C at which the lists exceed B, so the first compaction of a prompt that goes past it."""
    return (config.budget // config.checkpoint + 1) * config.checkpoint


def next_checkpoint(computed: int, config: KVConfig) -> int:
    return (computed // config.checkpoint + 1) * config.checkpoint


def position_key(
    block_hashes: Sequence[bytes], tokens: Sequence[int], position: int, hash_block_size: int, config: KVConfig
) -> bytes | None:
    """The key of the lists after the first `position` tokens, for a position inside a block (a turn checkpoint):
    vLLM's chained hash of the last whole block before it (which covers the cache salt and every extra key), then the
    tokens after that block. None before the first whole block (nothing there carries the salt)."""
    whole = position // hash_block_size
    if whole == 0 or len(block_hashes) < whole:
        return None
    tail = np.asarray(tokens[whole * hash_block_size : position], dtype=np.int64).tobytes()
    return checkpoint_key(block_hashes[whole - 1] + b"|" + tail, config)


def document_key(progress: Progress, hash_block_size: int, config: KVConfig) -> bytes | None:
    """The key of a compressed document (`kv_document`): its first `document` tokens under these settings, the same
    for the request that compresses it (`kv_reconstruct`) and for every request that resumes from it."""
    settings = replace(config, reconstruct=False, piece_key="", piece_start=0, piece_end=0)
    return position_key(progress.block_hashes, progress.tokens, config.document, hash_block_size, settings)


def reconstructs_its_document(progress: Progress, document: int, start: int = 0) -> bool:
    """The prompt is the document, an instruction, then the document again from token `start` to its end (what the
    compress route sends: the whole copy, or the last piece's): only then are the compressed lists the document's,
    so a request that says `kv_reconstruct` without it publishes nothing."""
    copied = document - start
    copy = progress.prompt_tokens - copied
    if copy < document:
        return False
    prompt = progress.tokens
    return all(prompt[copy + index] == prompt[start + index] for index in range(copied))


def chunk_end(record: CoreRequest, progress: Progress, block_size: int) -> int:
    """Where a `kv_checkpoint` request's next prompt chunk must end at the latest, so that a compaction the rules
    place inside the prompt (`kvserve.core.compaction`) ends a step: its next multiple of C; with `turns`, the next
    turn's end, or where its lists reach B + bs once a turn has ended (a miss compacts a resent reply where its
    decode did). The request's whole sequence when no such place comes before its end."""
    settings, computed = record.settings, progress.computed
    if settings.document:  # KVzip compacts where its prompt ends, or never; another policy where the document ends
        return settings.document if settings.document_tokens and computed < settings.document else progress.count
    if not settings.checkpoint_turns:
        return next_checkpoint(computed, settings)
    stops = [end for end in record.turns.all(progress.tokens, progress.count) if end > computed]
    if record.turns.ended_before(progress.tokens, progress.count, computed + 1) or record.compacted:
        stops.append(computed + max(settings.budget + block_size - record.longest_list(computed), 1))
    return min(stops, default=progress.count)


def miss_compactions(record: CoreRequest, progress: Progress, limit: int, block_size: int) -> list[int]:
    """Where a `kv_checkpoint=turns` miss of this sequence compacts, up to `limit` tokens."""
    ends = [end for end in record.turns.all(progress.tokens, progress.count) if end <= limit]
    return turn_positions(ends, record.settings.budget, block_size, limit)


def first_compaction(record: CoreRequest, progress: Progress, block_size: int) -> int:
    """Where a miss of this sequence first compacts: what plain prefix-cache blocks may cover before it. A document's
    reconstruction votes with every query past the document, so a plain hit covers the document at most."""
    settings = record.settings
    if settings.document:
        if settings.reconstruct:
            return settings.document + 1
        return settings.document_tokens or progress.count
    if not record.settings.checkpoint_turns:
        return first_compacting_checkpoint(record.settings)
    positions = miss_compactions(record, progress, progress.count, block_size)
    return positions[0] if positions else progress.count


def candidates(
    record: CoreRequest, progress: Progress, limit: int, block_size: int, hash_block_size: int
) -> list[tuple[int, bytes]]:
    """(position, key) of the checkpoints a miss of this sequence would publish up to `limit`, latest first."""
    settings = record.settings
    if settings.document:  # a request that starts with the document resumes from it compressed
        if settings.reconstruct or limit < settings.document:
            return []
        key = document_key(progress, hash_block_size, settings)
        return [] if key is None else [(settings.document, key)]
    if settings.checkpoint_turns:
        positions = miss_compactions(record, progress, limit, block_size)
        keys = [
            (p, position_key(progress.block_hashes, progress.tokens, p, hash_block_size, settings))
            for p in reversed(positions)
        ]
        return [(p, key) for p, key in keys if key is not None]
    first = first_compacting_checkpoint(settings)
    positions = range(limit // settings.checkpoint * settings.checkpoint, first - 1, -settings.checkpoint)
    return [(p, checkpoint_key(progress.block_hashes[p // hash_block_size - 1], settings)) for p in positions]


def publish_key(record: CoreRequest, progress: Progress, logical: int, hash_block_size: int) -> bytes | None:
    """The key a compaction after a step ending at `logical` tokens publishes its lists under, or None. A turn
    checkpoint at a prompt end that is no turn's (a completion prompt) makes the request's lists depend on where its
    prompt ended, so from then on it publishes nothing."""
    settings = record.settings
    if record.private:  # it stopped publishing (no room for a copy)
        return None
    if settings.document:
        if settings.document_tokens:  # compacted where the document ends
            return document_key(progress, hash_block_size, settings) if logical == settings.document else None
        if not settings.compresses_document or logical < progress.prompt_tokens:
            return None
        if not reconstructs_its_document(progress, settings.document, settings.piece_start):
            logger.warning(
                "request %s: kv_reconstruct, but its prompt is not its document, an instruction and the document "
                "again; its lists are not published",
                record.request_id,
            )
            return None
        return document_key(progress, hash_block_size, settings)
    if settings.checkpoint_turns:
        if record.turn_private:
            return None
        turns = record.turns
        if not turns.at(progress.tokens, logical) and not turns.ended_before(progress.tokens, progress.count, logical):
            record.turn_private = True
            return None
        if logical < progress.prompt_tokens:
            # inside a resent conversation: a later turn resumes from this prompt's end or later, never from here, and
            # publishing every block of a recomputed conversation pushed the useful checkpoints out of a small pool
            return None
        return position_key(progress.block_hashes, progress.tokens, logical, hash_block_size, settings)
    whole_blocks = logical // hash_block_size
    if not settings.checkpoint or logical % settings.checkpoint or len(progress.block_hashes) < whole_blocks:
        return None
    return checkpoint_key(progress.block_hashes[whole_blocks - 1], settings)


@dataclass(frozen=True)
class Published:
    """The engine core's record of one published checkpoint."""

    report: PageReport  # the lists as the publishing request's workers reported them (charges an adopting request)
    block_ids: tuple[int, ...]  # the vLLM blocks holding the lists, in order
    hashes: tuple[bytes, ...]  # the block hash each block is cached under

    @property
    def position(self) -> int:
        """Logical tokens the lists cover."""
        return self.report.logical_tokens


@dataclass
class CheckpointRegistry:
    """Published checkpoints by key. A checkpoint lives while vLLM keeps every one of its blocks under its hash
    (`cached_block_id(block_hash)`: the block vLLM's cache maps the hash to, or None); `prune` drops the others (vLLM
    reused a block) and says which, for the workers."""

    entries: dict[bytes, Published] = field(default_factory=dict)

    def alive(self, key: bytes, cached_block_id: Callable[[bytes], int | None]) -> Published | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        for block_id, block_hash in zip(entry.block_ids, entry.hashes, strict=True):
            if cached_block_id(block_hash) != block_id:
                return None
        return entry

    def prune(self, cached_block_id: Callable[[bytes], int | None]) -> list[CheckpointId]:
        dead = [key for key in self.entries if self.alive(key, cached_block_id) is None]
        return [(key, self.entries.pop(key).block_ids) for key in dead]
