"""The engine core's record of one request (`CoreRequest`): everything it knows about the request beyond vLLM's own
`Request`, and what that request is charged once its lists are compacted.

Once a request has compacted, its (layer, KV head) lists hold fewer entries than it has tokens, each list its own
count, and a vLLM block is just `L * H` pages any list may use (`kvserve/worker/pages.py`). Its record then keeps the
workers' last `PageReport`, from which it is charged `cdiv(pages + the pages its next tokens take, L * H)` blocks:
under pipeline parallelism each stage holds its own layers' pages in the same blocks, so the most any stage needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.config import KVConfig, PrefixSharing
from kvserve.core.turns import TurnEnds
from kvserve.messages import PageReport, cdiv


@dataclass(frozen=True)
class Progress:
    """Where a request's sequence stands, as the rules read it (the boundary reads it off vLLM's `Request`)."""

    tokens: Sequence[int]  # prompt then output tokens so far
    prompt_tokens: int
    computed: int  # tokens in the cache: vLLM's num_computed_tokens
    block_hashes: Sequence[bytes] = ()  # vLLM's chained hash of each whole block (tokens, cache salt, extra keys)

    @property
    def count(self) -> int:
        return len(self.tokens)


@dataclass
class CoreRequest:
    """Everything the engine core knows about one request beyond vLLM's `Request`."""

    request_id: str
    settings: KVConfig  # as the front end validated them (`kvserve/config.py`)
    sharing: PrefixSharing | None = None  # how it shares the prefix cache; None: it is served without eviction
    admission_cap: int | None = None  # kv_evict_every_chunk: the most entries it ever holds (what admission reserves)
    turns: TurnEnds | None = None  # kv_checkpoint=turns: where its chat turns end
    # its lists at its last compaction, as the workers reported them (or those of the checkpoint it resumed from);
    # None: never compacted, every list holds every token
    report: PageReport | None = None
    private: bool = False  # it stopped publishing: no room for a compaction's copy out of cached blocks
    turn_private: bool = False  # kv_checkpoint=turns: it compacted where no turn ended, so it publishes nothing more
    resuming: bytes | None = None  # the checkpoint its prefix-cache hit resumes from, until its first step
    candidates: tuple[int, list[tuple[int, bytes]]] | None = None  # waiting: (limit, checkpoints a miss publishes)
    spare_blocks: int = 0  # blocks this step's allocation adds for a compaction's copies out of protected blocks
    spare_taken: int = 0  # those its last allocation added
    in_flight: bool = False  # pipeline parallelism: in a batch whose output has not come back
    released: tuple[int, ...] = ()  # pipeline parallelism: blocks the last stage gave back, for the earlier stages
    reported_evicted: int | None = None  # the evicted count its outputs last carried to the front end

    @property
    def evicts(self) -> bool:
        return self.sharing is not None

    @property
    def compacted(self) -> bool:
        """Its lists hold fewer entries than it has tokens (it compacted, or resumed from a checkpoint)."""
        return self.report is not None

    @property
    def publishes(self) -> bool:
        """Whether its complete blocks enter the prefix cache now (a plain request's always do)."""
        if self.sharing is None:
            return True
        return self.sharing.publishes and not self.private and self.report is None

    def longest_list(self, num_tokens: int) -> int:
        """Entries in its longest list once it covers `num_tokens` logical tokens."""
        report = self.report
        return num_tokens if report is None else report.longest + num_tokens - report.logical_tokens

    def stage_pages(self, num_tokens: int) -> list[tuple[int, int]] | None:
        """Per pipeline stage: (pages its lists hold once they cover `num_tokens` logical tokens, pages per block).
        None: never compacted."""
        report = self.report
        if report is None:
            return None
        new_tokens = max(num_tokens - report.logical_tokens, 0)
        return [(stage.pages_after(new_tokens), stage.pages_per_block) for stage in report.stages]

    def pages_held(self, num_tokens: int) -> int | None:
        """Pages its lists hold once they cover `num_tokens` logical tokens, over all stages (None: never
        compacted)."""
        stages = self.stage_pages(num_tokens)
        return None if stages is None else sum(pages for pages, _ in stages)

    def blocks_held(self, num_tokens: int) -> int | None:
        """Blocks it needs once its lists cover `num_tokens` logical tokens: the most any stage needs for its pages
        (None: never compacted)."""
        stages = self.stage_pages(num_tokens)
        return None if stages is None else max(cdiv(pages, per_block) for pages, per_block in stages)

    def evicted_tokens(self, pages_per_block: int) -> int:
        """Tokens of the sequence no longer in the cache, averaged over the (layer, head) lists."""
        report = self.report
        if report is None:
            return 0
        return report.logical_tokens - round(report.entries / pages_per_block)
