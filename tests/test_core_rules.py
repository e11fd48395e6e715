"""The engine core's rules (`kvserve/core/`) on kvserve's own types, with no engine: when a request compacts and to
how many entries, where its checkpoints fall, what a prefix-cache hit may cover, when the pool is short, which waiting
request goes first. The tables follow the rules as kvserve/core/compaction.py's docstring states them; the chunked
misses check that the step-by-step rule, the chunk cuts and the positions a lookup computes from the tokens alone
agree."""

from __future__ import annotations

import random

import pytest

from kvserve.config import parse_kv_config
from kvserve.core import turns as turns_module
from kvserve.core.admission import OVERTAKE_LIMIT_S, resumable_first
from kvserve.core.checkpoints import (
    candidates,
    checkpoint_key,
    chunk_end,
    first_compacting_checkpoint,
    first_compaction,
    position_key,
    publish_key,
)
from kvserve.core.compaction import StepEnd, compaction_after, drafts_allowed, entries_to_keep, is_decode, step_end
from kvserve.core.prefix import copyable_hit, hit_limit
from kvserve.core.pressure import short_of_blocks
from kvserve.core.record import CoreRequest, Progress
from kvserve.core.turns import TurnEnds, turn_positions
from kvserve.messages import PageReport, StagePages

BS, B = 32, 256
MARKER = (7, 8, 9)  # a generation marker: three tokens no other token of these sequences uses


def settings(**asked):
    return parse_kv_config({"kv_policy": "snapkv", "kv_budget": B, **asked}, defaults={})


SNAPKV = settings()
EVERY_CHUNK = settings(kv_evict_every_chunk=True)
HEADS = settings(kv_allocation="heads")
PRESSURE = settings(kv_evict_when="pressure")
C128 = settings(kv_checkpoint=128)
TURNS = settings(kv_checkpoint="turns")
GATE = parse_kv_config({"kv_policy": "attention_gate"}, defaults={})
GATE_64 = parse_kv_config({"kv_policy": "attention_gate", "kv_budget": 64}, defaults={})
DUO = parse_kv_config({"kv_policy": "duoattention", "kv_budget": B}, defaults={})


def end(logical, cached, decode=False, done=False, here=False, ended=False) -> StepEnd:
    return StepEnd(logical, cached, decode, done, turn_ends_here=here, turn_ended=ended)


RULES = [
    # (settings, step, compacted, longest, under pressure, entries kept or None)
    (SNAPKV, end(300, 300, done=True), False, None, False, B),  # the prompt's end, over B
    (SNAPKV, end(256, 256, done=True), False, None, False, None),  # not over B
    (SNAPKV, end(300, 300), False, None, False, None),  # an earlier chunk
    (EVERY_CHUNK, end(300, 300), False, None, False, B),  # ... compacts with kv_evict_every_chunk
    (SNAPKV, end(400, B + BS - 1, decode=True), True, B, False, None),  # decoding: not a block since
    (SNAPKV, end(400, B + BS, decode=True), True, B, False, B),  # a block of new tokens since
    (HEADS, end(400, 331, decode=True), True, 300, False, None),  # an allocation: the longest list grew by < bs
    (HEADS, end(400, 332, decode=True), True, 300, False, B),  # ... by bs
    (GATE, end(300, 300, done=True), False, None, False, 300),  # the gate decides, no budget
    (GATE_64, end(300, 300, done=True), False, None, False, 64),  # ... the budget caps
    (GATE, end(400, 400, decode=True), True, 300, False, None),  # no budget: no decode rule
    (DUO, end(100, 100, done=True), False, None, False, B),  # own counts: the prompt compacts under B too
    (PRESSURE, end(300, 300, done=True), False, None, False, None),  # room in the pool: served as full
    (PRESSURE, end(300, 300, done=True), False, None, True, B),  # short of blocks: the eager rule
    (PRESSURE, end(400, B + BS, decode=True), True, B, False, B),  # compacted once: the eager rules from then
    (C128, end(384, 384), False, None, False, B),  # a multiple of C, over B
    (C128, end(300, 300, done=True), False, None, False, None),  # not a multiple of C: not even at the end
    (C128, end(256, 256), False, None, False, None),  # a multiple of C, not over B
    (C128, end(512, 384, decode=True), True, B, False, B),  # decoding too, at multiples of C
    (TURNS, end(300, 300, here=True), False, None, False, B),  # a turn's end, over B
    (TURNS, end(200, 200, here=True), False, None, False, None),  # a turn's end, not over B
    (TURNS, end(400, B + BS - 1, ended=True), True, B, False, None),  # after a turn: the decode rule
    (TURNS, end(400, B + BS, ended=True), True, B, False, B),
    (TURNS, end(400, B + BS, decode=True), True, B, False, B),
    (TURNS, end(300, 300, done=True), False, None, False, B),  # a prompt that ends where no turn does
    (TURNS, end(300, 300), False, None, False, None),  # inside a prompt, before any turn
]


@pytest.mark.parametrize(("config", "step", "compacted", "longest", "pressure", "kept"), RULES)
def test_when_and_to_how_many_a_request_compacts(config, step, compacted, longest, pressure, kept):
    found = entries_to_keep(config, step, compacted=compacted, longest=longest, block_size=BS, under_pressure=pressure)
    assert found == kept


@pytest.mark.parametrize(
    ("logical", "num_new", "prompt", "decode"),
    [(101, 1, 100, True), (100, 1, 100, False), (101, 2, 100, False), (50, 1, 100, False), (300, 1, 100, True)],
)
def test_a_decode_step_is_one_generated_token(logical, num_new, prompt, decode):
    assert is_decode(logical, num_new, prompt) is decode


def test_a_decode_step_may_verify_drafts_after_its_token():
    assert is_decode(104, 4, 100, drafts=3)  # the first sampled token, then 3 drafts
    assert not is_decode(104, 4, 100, drafts=2)  # two tokens of its own: a chunk
    assert not is_decode(103, 4, 100, drafts=3)  # starts inside the prompt


def decode_compactions(config, prompt: int, steps: int, wanted: int, seed: int | None) -> list[int]:
    """Decodes `steps` tokens after a `prompt`-token prompt. Each step asks for `wanted` drafts (None: no
    speculation) and takes what `drafts_allowed` gives; a random number of them is accepted. A step with drafts must
    not compact; the others compact where `compaction_after` says. The positions compacted at."""
    rng = random.Random(seed)
    tokens = sequence(prompt + steps + wanted + 1, [])
    record, computed, compacted_at = record_for(config, tokens), prompt, []
    _, keep = compaction_after(record, Progress(tokens, prompt, 0), prompt, prompt, BS, under_pressure=False)
    if keep is not None:
        record.report = report(prompt, keep)
    while computed < prompt + steps:
        progress = Progress(tokens[: computed + 1], prompt, computed)
        drafts = 0 if seed is None else drafts_allowed(record, progress, computed, wanted, BS, under_pressure=False)
        logical = computed + 1 + drafts
        _, keep = compaction_after(record, progress, logical, 1 + drafts, BS, under_pressure=False, drafts=drafts)
        if drafts:
            assert keep is None  # a step that verifies drafts never compacts
            computed += 1 + rng.randrange(drafts + 1)  # its own token and the accepted drafts
            continue
        if keep is not None:
            record.report = report(logical, keep)
            compacted_at.append(logical)
        computed = logical
    return compacted_at


@pytest.mark.parametrize("config", [SNAPKV, HEADS, C128, TURNS, DUO], ids=["eager", "heads", "c128", "turns", "duo"])
@pytest.mark.parametrize("seed", range(3))
def test_drafts_stop_where_a_one_token_step_would_compact(config, seed):
    plain = decode_compactions(config, 300, 400, 4, seed=None)
    assert len(plain) >= 3
    assert decode_compactions(config, 300, 400, 4, seed) == plain


def test_a_gated_request_gets_no_drafts():
    tokens = sequence(400, [])
    record = record_for(GATE, tokens)
    assert drafts_allowed(record, Progress(tokens, 300, 350), 350, 4, BS, under_pressure=False) == 0


def test_a_drafter_with_its_own_cache_drafts_until_the_request_compacts():
    """A draft model's cache follows vLLM's block table, which a compacted request's no longer does: drafts stop at
    its first compaction (a drafter without a cache, n-gram, keeps drafting between compactions)."""
    tokens = sequence(700, [])
    record = record_for(SNAPKV, tokens)
    short = Progress(tokens[:101], 100, 100)  # below the budget: not compacted yet
    before = drafts_allowed(record, short, 100, 4, BS, under_pressure=False)
    assert before == drafts_allowed(record, short, 100, 4, BS, under_pressure=False, drafter_cache=True) > 0
    record.report = report(300, B)  # the prompt compacted where it ended
    after = Progress(tokens[:301], 300, 300)
    assert drafts_allowed(record, after, 300, 4, BS, under_pressure=False) > 0
    assert drafts_allowed(record, after, 300, 4, BS, under_pressure=False, drafter_cache=True) == 0


def report(logical: int, kept: int, heads: int = 3) -> PageReport:
    """Lists of `kept` entries in each of `heads` lists after a compaction at `logical` tokens."""
    pages = heads * -(-kept // BS)
    free = [0] * BS
    free[(-kept) % BS] = heads
    stage = StagePages(pages=pages, free_slots=tuple(free), pages_per_block=heads, longest=kept, entries=kept * heads)
    return PageReport(logical_tokens=logical, stages=(stage,), released_block_ids=())


def record_for(config, tokens) -> CoreRequest:
    record = CoreRequest("r", config, sharing=config.prefix_sharing())
    if config.checkpoint_turns:
        record.turns = TurnEnds(MARKER)
    return record


def sequence(length: int, turn_ends: list[int], seed: int = 0) -> list[int]:
    """Tokens (10..99) with the marker ending at each of `turn_ends`."""
    rng = random.Random(seed)
    tokens = [rng.randrange(10, 100) for _ in range(length)]
    for position in turn_ends:
        tokens[position - len(MARKER) : position] = MARKER
    return tokens


def chunked_miss(config, tokens: list[int], chunk: int) -> list[int]:
    """Computes `tokens` as one prompt in chunks of at most `chunk` tokens, each cut where `chunk_end` says, and
    compacts where `compaction_after` says: the positions it compacted at."""
    record, computed, compacted_at = record_for(config, tokens), 0, []
    while computed < len(tokens):
        progress = Progress(tokens, prompt_tokens=len(tokens), computed=computed)
        stop = min(computed + chunk, len(tokens), chunk_end(record, progress, BS))
        _, keep = compaction_after(record, progress, stop, stop - computed, BS, under_pressure=False)
        if keep is not None and stop < len(tokens):  # (the prompt's own end follows the eager rule)
            record.report = report(stop, keep)
            compacted_at.append(stop)
        computed = stop
    return compacted_at


@pytest.mark.parametrize("chunk", [1, 37, 128, 1000])
@pytest.mark.parametrize("seed", range(4))
def test_a_chunked_miss_compacts_where_the_turn_positions_say(chunk, seed):
    rng = random.Random(seed)
    ends = sorted(rng.sample(range(40, 1500), 4))
    tokens = sequence(1600, ends, seed)
    expected = [p for p in turn_positions(ends, B, BS, len(tokens)) if p < len(tokens)]
    assert expected  # the walk compacts somewhere in these sequences
    assert chunked_miss(TURNS, tokens, chunk) == expected


@pytest.mark.parametrize("chunk", [1, 100, 128, 1000])
def test_a_chunked_miss_compacts_at_every_multiple_of_c_from_the_first_compacting_one(chunk):
    tokens = sequence(1000, [])
    first = first_compacting_checkpoint(C128)
    assert chunked_miss(C128, tokens, chunk) == list(range(first, 1000, 128))


def test_turn_ends_are_scanned_once_per_token_count_and_never_while_decoding(monkeypatch):
    scans = []
    monkeypatch.setattr(turns_module, "marker_ends", lambda *args: scans.append(args[2]) or [120])
    ends = TurnEnds(MARKER)
    tokens = sequence(200, [120])
    assert ends.all(tokens, 200) == [120] and ends.all(tokens, 200) == [120]
    assert ends.ended_before(tokens, 201, 150)  # an end was found: no new scan for a grown sequence
    assert scans == [200]
    record = record_for(TURNS, tokens)
    record.report = report(190, B)
    for logical in range(201, 230):  # decode steps
        step_end(record, Progress(tokens + [11] * (logical - 200), 120, logical - 1), logical, 1)
    assert scans == [200]


def test_publish_and_lookup_agree_on_every_checkpoint_key():
    tokens = sequence(1000, [])
    hashes = [bytes([n]) * 8 for n in range(1000 // BS)]
    progress = Progress(tokens, prompt_tokens=1000, computed=0, block_hashes=hashes)
    record = record_for(C128, tokens)
    published = {p: publish_key(record, progress, p, BS) for p in range(1, 1001)}
    assert {p for p, key in published.items() if key is not None} == set(range(128, 1001, 128))
    found = candidates(record, progress, 900, BS, BS)
    assert [p for p, _ in found] == list(range(896, first_compacting_checkpoint(C128) - 1, -128))
    assert all(published[p] == key == checkpoint_key(hashes[p // BS - 1], C128) for p, key in found)
    record.private = True  # stopped publishing: no room for a compaction's copy
    assert publish_key(record, progress, 384, BS) is None


def test_a_turn_request_publishes_at_turns_after_its_prompt_and_stops_after_a_prompt_end_that_is_no_turn():
    tokens = sequence(900, [300, 700])
    hashes = [bytes([n]) * 8 for n in range(900 // BS)]
    record = record_for(TURNS, tokens)
    after_prompt = Progress(tokens, prompt_tokens=300, computed=300, block_hashes=hashes)
    assert publish_key(record, after_prompt, 300, BS) == position_key(hashes, tokens, 300, BS, TURNS)
    inside = Progress(tokens, prompt_tokens=800, computed=0, block_hashes=hashes)
    assert publish_key(record, inside, 700, BS) is None  # inside a resent conversation
    plain = record_for(TURNS, tokens)
    no_turn_yet = Progress(tokens, prompt_tokens=250, computed=250, block_hashes=hashes)
    assert publish_key(plain, no_turn_yet, 250, BS) is None and plain.turn_private
    assert publish_key(plain, after_prompt, 300, BS) is None  # nothing more after that
    positions = turn_positions([300, 700], B, BS, 900)
    assert [p for p, _ in candidates(record, after_prompt, 900, BS, BS)] == positions[::-1]
    assert first_compaction(record, after_prompt, BS) == positions[0]


@pytest.mark.parametrize(
    ("hit", "num_tokens", "tail", "copyable", "first", "limit"),
    [
        (640, 700, 32, 700, None, 640),  # the whole hit leaves the tail to compute
        (700, 700, 32, 700, None, 640),  # cut to leave the tail, in whole blocks
        (700, 700, 1, 700, None, 672),
        (640, 700, 32, 320, None, 320),  # no more than the row can copy out of
        (640, 700, 32, 700, 384, 352),  # kv_checkpoint: before the first compaction, less the tail
        (20, 700, 32, 700, None, 0),
    ],
)
def test_what_a_prefix_hit_may_cover(hit, num_tokens, tail, copyable, first, limit):
    assert hit_limit(hit, num_tokens, tail, copyable, BS, first) == limit


@pytest.mark.parametrize(
    ("num_tokens", "keep", "row_blocks", "spare", "copyable"),
    [
        (700, None, 64, 0, 700),  # the prompt does not compact
        (700, 256, 64, 0, 700),  # 22 blocks + 8 copies fit a 64-block row
        (2000, 512, 64, 0, BS),  # 63 blocks leave 1 for 16 copies: hit what the row can take
        (2048, 512, 64, 0, 0),
        (700, 256, 31, 1, 700),  # 22 + 9 fit 31
        (700, 256, 30, 1, 8 * BS),
    ],
)
def test_a_hit_is_cut_to_what_the_row_can_copy_out_of(num_tokens, keep, row_blocks, spare, copyable):
    assert copyable_hit(num_tokens, keep, row_blocks, spare, BS) == copyable


@pytest.mark.parametrize(
    ("free", "uncomputed", "running", "was_short", "short"),
    [
        (10, [1, 1], 2, False, False),  # 2 blocks needed + 2 spare <= 10
        (3, [1, 1], 2, False, True),  # 2 + 2 > 3
        (10, [100, 64], 1, False, False),  # 4 + 2 blocks + 1 spare <= 10
        (6, [100, 64], 1, False, True),
        (9, [100, 64], 1, True, True),  # short before: stays short until twice the need (12)
        (12, [100, 64], 1, True, False),
    ],
)
def test_when_the_pool_is_short(free, uncomputed, running, was_short, short):
    assert short_of_blocks(free, uncomputed, running, BS, was_short) is short


def test_waiting_requests_that_resume_go_first_unless_another_has_waited_too_long():
    now = 1000.0
    waiting = [("old", now - OVERTAKE_LIMIT_S - 1, False), ("a", now - 5, False), ("hit", now - 1, True)]
    waiting += [("b", now - 2, False), ("hit2", now, True)]
    order = resumable_first(waiting, lambda item: item[2], lambda item: item[1], now)
    assert [item[0] for item in order] == ["old", "hit", "hit2", "a", "b"]
    none_resume = resumable_first(waiting, lambda item: False, lambda item: item[1], now)
    assert none_resume == waiting
