"""WHEN a request compacts and to HOW MANY entries: the one place these rules live (the worker decides WHICH entries).

Rules (B = the request's budget, bs = block size), checked for a step once it is scheduled, and for the allocation
of that step (which must hold the compaction's spare blocks):
- the chunk that completes the prompt (or a preempted request's recompute): compact to B if the cache exceeds B;
- any earlier prompt chunk: the same, only with `kv_evict_every_chunk`;
- a decode step: compact back to B once the cache reaches B + bs, so eviction runs once per block of new tokens
  (with `kv_allocation`, or a policy with its own counts, once the longest list grew by bs since the last
  compaction: each list returns to its share);
- `kv_checkpoint=C`: instead of all of the above, at every step that ends at a multiple of C tokens (prompt chunks
  are cut to end there: `kvserve.core.checkpoints.chunk_end`), prompt and decode alike; the lists then hold B to
  B + C entries;
- `kv_checkpoint=turns`: where a chat turn's prompt ends (its lists over B), and once a turn has ended by the decode
  rule for every later token, prompt or reply (chunks are cut there too); a prompt that ends where no turn does
  compacts there as eager eviction does;
- `kv_document=N` (KVzip): a request that reconstructs the document (`kv_reconstruct`: its prompt is the document,
  an instruction and the document again, or its last piece) compacts once, where its prompt ends, keeping B of the
  document's entries; the reconstruction of an earlier piece, and a request that starts with the document, never
  compact (the latter resumes from the compressed document, or on a miss is served in full);
- `kv_document=N` (any other policy): once, where the step that completes the document's N tokens ends (its chunk
  is cut there), scored by the document's own queries; nothing after it, prompt or reply. A request that resumed
  from the compressed document compacts nothing;
- `kv_evict_when=pressure`: none of the above until the pool is short (`kvserve.core.pressure`); until its first
  compaction the request is a `full` one, and the first step it runs under pressure compacts it by the rules above.

Each (layer, KV head) list has its own count; "the cache" in these rules is the longest list. A ragged policy
(Attention-Gate) decides its counts in the worker: its prompt always compacts, each head to at most B (or to what its
gate kept, without a budget); during decoding the B + bs rule applies only when a budget was given. A policy with
its own counts (DuoAttention) also always compacts its prompt, with B, and each head keeps its count for B or all it
holds, whichever is less.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import KVConfig
from kvserve.core.record import CoreRequest, Progress


@dataclass(frozen=True)
class StepEnd:
    """One request at the end of a scheduled step, before any compaction."""

    logical: int  # tokens it has computed after the step
    cached: int  # entries in its longest list then
    decode: bool  # the step generates one token (not a prompt chunk)
    prompt_done: bool  # the step completes what it has to compute (its prompt, or a recompute of prompt and output)
    turn_ends_here: bool = False  # kv_checkpoint=turns: a chat turn's prompt ends at `logical`
    turn_ended: bool = False  # kv_checkpoint=turns: a turn ended before `logical`


def entries_to_keep(
    settings: KVConfig,
    step: StepEnd,
    *,
    compacted: bool,
    longest: int | None,
    block_size: int,
    under_pressure: bool,
) -> int | None:
    """The entries a request compacts to after this step, or None if it does not compact now. `compacted`: its
    lists were compacted before (by itself, or by the checkpoint it resumed from); `longest`: its longest list at
    that last compaction (None: never compacted)."""
    if settings.document:  # a document compacts once: where its reconstruction ends, or where it ends
        if not settings.compresses_document or compacted:
            return None
        done = step.logical == settings.document if settings.document_tokens else step.prompt_done
        return settings.budget if done else None
    if settings.defers and not under_pressure and not compacted:
        return None  # kv_evict_when=pressure, and the pool has room: served as `full` for now
    budget = settings.budget
    if settings.checkpoint_turns:
        if step.turn_ends_here:
            return budget if step.cached > budget else None
        if step.decode or step.turn_ended or compacted:
            return budget if step.cached >= budget + block_size else None
        return budget if step.prompt_done and step.cached > budget else None
    if settings.checkpoint:  # at every multiple of C, prompt or not, and nowhere else: lists hold B to B + C
        return budget if step.logical % settings.checkpoint == 0 and step.cached > budget else None
    if step.decode:
        if budget is None:
            return None
        # an allocation keeps some lists longer than B: compact once a block of tokens came since the last time
        varies = settings.allocation != "uniform" or settings.own_counts
        grown_from = longest if longest is not None and varies else budget
        return budget if step.cached >= grown_from + block_size else None
    if not step.prompt_done and not settings.evict_every_chunk:
        return None
    if settings.ragged:  # the gate decides; the budget caps
        return step.cached if budget is None else min(budget, step.cached)
    if settings.own_counts and budget is not None:  # the policy's counts for B, each capped at what a head holds
        return budget  # (a prompt shorter than B still drops its streaming heads' middle)
    return budget if step.cached > budget else None


def is_decode(logical: int, num_new: int, prompt_tokens: int, drafts: int = 0) -> bool:
    """Whether a step of `num_new` tokens that ends at `logical` tokens is a decode step: one generated token, and
    with speculative decoding `drafts` draft tokens after it that the step verifies."""
    return num_new - drafts == 1 and logical - num_new >= prompt_tokens


def step_end(record: CoreRequest, progress: Progress, logical: int, num_new: int) -> StepEnd:
    """`record`'s request at the end of a step of `num_new` tokens that ends at `logical` tokens."""
    decode = is_decode(logical, num_new, progress.prompt_tokens)
    turns = record.turns if record.settings.checkpoint_turns else None
    turn_here = turns is not None and turns.at(progress.tokens, logical)
    # read only where the rule reads it: a decoding request is not scanned for turn ends at every token
    turn_ended = turns is not None and not turn_here and not decode
    return StepEnd(
        logical=logical,
        cached=record.longest_list(logical),
        decode=decode,
        prompt_done=logical >= progress.count,
        turn_ends_here=turn_here,
        turn_ended=turn_ended and turns.ended_before(progress.tokens, progress.count, logical),
    )


def compaction_after(
    record: CoreRequest,
    progress: Progress,
    logical: int,
    num_new: int,
    block_size: int,
    under_pressure: bool,
    drafts: int = 0,
) -> tuple[int, int | None]:
    """For a step of `num_new` tokens ending at `logical` tokens: (entries in the longest list then, entries it
    compacts to or None). One rule for the step's plan and for the allocation that must hold the plan's spare
    blocks. A step that verifies `drafts` draft tokens never compacts (`drafts_allowed` gave it only drafts that
    end before the next compaction)."""
    if drafts:
        return record.longest_list(logical), None
    step = step_end(record, progress, logical, num_new)
    report = record.report
    keep = entries_to_keep(
        record.settings,
        step,
        compacted=report is not None,
        longest=None if report is None else report.longest,
        block_size=block_size,
        under_pressure=under_pressure,
    )
    return step.cached, keep


def drafts_allowed(
    record: CoreRequest,
    progress: Progress,
    computed: int,
    wanted: int,
    block_size: int,
    under_pressure: bool,
    drafter_cache: bool = False,
) -> int:
    """Speculative decoding: how many of `wanted` draft tokens a decoding request that has computed `computed`
    tokens may verify in its next step. A step with drafts never compacts, so the drafts stop before the first
    token whose one-token step would compact by the rules above (0 when the next token's does: that step runs
    plain and compacts). However many drafts are accepted, every compaction then falls on the same one-token step,
    with the same cache, as without speculation. A gated policy decides per token in its attention pass: no drafts.
    `drafter_cache`: the drafter keeps a KV cache of its own, addressed by vLLM's block table (a draft model, an
    EAGLE head), which a compacted request's table no longer follows (it lists the blocks the request kept): its
    drafts would be guesses from the wrong entries, so a compacted request gets none."""
    if record.settings.ragged or (drafter_cache and record.compacted):
        return 0
    for draft in range(wanted + 1):
        end = computed + 1 + draft  # the step that ends with this draft's token, were it taken alone
        if compaction_after(record, progress, end, 1, block_size, under_pressure)[1] is not None:
            return max(draft - 1, 0)
    return wanted
