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

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.config import KVConfig
from kvserve.engine.plan import CheckpointId, PageReport
from kvserve.engine.request_state import LayerState, RequestState


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


@functools.lru_cache(maxsize=8)
def generation_marker(tokenizer: str, trust_remote_code: bool = False) -> tuple[int, ...] | None:
    """The tokens the model's chat template appends to ask for a reply (`<|im_start|>assistant\n`): every chat
    prompt ends with them, and a later turn's prompt holds them where the earlier turn's prompt ended. None: the
    model has no chat template, or its template does not append one fixed sequence."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
    if not getattr(loaded, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "x"}]

    def ids(generation_prompt: bool) -> list[int]:
        encoded = loaded.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    asking, plain = ids(True), ids(False)
    if len(asking) <= len(plain) or asking[: len(plain)] != plain:
        return None
    return tuple(asking[len(plain) :])


def marker_ends(tokens: Sequence[int], marker: tuple[int, ...], limit: int) -> list[int]:
    """Positions p <= limit where tokens[p - len(marker) : p] is the marker."""
    array = np.asarray(tokens[:limit], dtype=np.int64)
    size = len(marker)
    starts = np.flatnonzero(array[: max(len(array) - size + 1, 0)] == marker[0])
    return [int(s) + size for s in starts if tuple(array[s : s + size]) == marker]


def turn_positions(ends: list[int], budget: int, block_size: int, limit: int) -> list[int]:
    """Where a `kv_checkpoint=turns` request that starts from nothing compacts, up to `limit` tokens: at each turn's
    end (a marker end, once its lists exceed B), and after the first one wherever its lists reach B + block size
    (the decode rule, which a reply followed when it was generated). The scheduler's `_turn_keep` is this rule step
    by step; a request that compacted at a prompt end that is no turn's end publishes nothing after it."""
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


@dataclass
class Published:
    """The scheduler's record of one published checkpoint."""

    report: PageReport  # the lists as the publishing request's worker reported them (charges an adopting request)
    blocks: list  # vLLM KVCacheBlocks, in order
    hashes: list  # their BlockHashWithGroupId

    @property
    def position(self) -> int:
        """Logical tokens the lists cover."""
        return self.report.logical_tokens

    @property
    def id(self) -> tuple[int, ...]:
        return tuple(block.block_id for block in self.blocks)


@dataclass
class CheckpointRegistry:
    """Published checkpoints by key. A checkpoint lives while vLLM keeps every one of its blocks under its hash;
    `prune` drops the others (vLLM reused a block) and says which, for the workers."""

    entries: dict[bytes, Published] = field(default_factory=dict)

    def alive(self, key: bytes, block_pool) -> Published | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        for block, block_hash in zip(entry.blocks, entry.hashes, strict=True):
            cached = block_pool.cached_block_hash_to_block.get_one_block(block_hash)
            if cached is None or cached.block_id != block.block_id:
                return None
        return entry

    def prune(self, block_pool) -> list[CheckpointId]:
        dead = [key for key in self.entries if self.alive(key, block_pool) is None]
        return [(key, self.entries.pop(key).id) for key in dead]


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


def lists_of(state: RequestState) -> CheckpointLists | None:
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


def resume_from(state: RequestState, lists: CheckpointLists, block_ids: list[int]) -> None:
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
