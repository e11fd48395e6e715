"""The engine core's record of a request and its life events (`kvserve/core/record.py`, `kvserve/core/requests.py`),
with no engine: what a compacted request is charged, what each event changes."""

from __future__ import annotations

from kvserve.config import KVConfig, parse_kv_config
from kvserve.core.checkpoints import checkpoint_key
from kvserve.core.record import CoreRequest, Progress
from kvserve.core.requests import CoreRequests
from kvserve.messages import PageReport, StagePages, cdiv

BS, LAYERS, HEADS = 32, 30, 3
PAGES_PER_BLOCK = LAYERS * HEADS


def settings(**asked) -> KVConfig:
    return parse_kv_config({"kv_policy": "snapkv", "kv_budget": 256, **asked}, defaults={})


def lists(logical: int, counts: list[int], stages: int = 1) -> PageReport:
    """Every stage's lists hold `counts` entries, one count per list (its layers x heads lists)."""
    free = [0] * BS
    for count in counts:
        free[(-count) % BS] += 1
    stage = StagePages(
        pages=sum(cdiv(count, BS) for count in counts),
        free_slots=tuple(free),
        pages_per_block=len(counts),
        longest=max(counts),
        entries=sum(counts),
    )
    return PageReport(logical_tokens=logical, stages=(stage,) * stages, released_block_ids=())


def core(evicting: bool = True) -> CoreRequests:
    return CoreRequests(
        evicting=evicting,
        block_size=BS,
        pages_per_block=PAGES_PER_BLOCK,
        bytes_per_block=1024,
        chunk_tokens=512,
        marker=lambda: (7, 8, 9),
    )


def test_a_compacted_request_is_charged_by_the_pages_its_lists_take():
    record = CoreRequest("r", settings(), sharing=settings().prefix_sharing())
    assert record.blocks_held(1000) is None and record.longest_list(1000) == 1000 and not record.compacted
    counts = [256] * (PAGES_PER_BLOCK - 10) + [250] * 10  # ten lists have 6 free slots in their last page
    record.report = lists(1000, counts)
    assert record.longest_list(1010) == 266
    # 8 pages per list now; 6 more tokens fit the ten short lists' last pages, a seventh takes a page each
    assert record.pages_held(1000) == 8 * PAGES_PER_BLOCK
    assert record.pages_held(1006) == 8 * PAGES_PER_BLOCK + (PAGES_PER_BLOCK - 10)
    assert record.pages_held(1007) == 9 * PAGES_PER_BLOCK
    assert record.blocks_held(1007) == 9
    assert record.evicted_tokens(PAGES_PER_BLOCK) == 1000 - round(sum(counts) / PAGES_PER_BLOCK)
    pipelined = CoreRequest("p", settings(), sharing=settings().prefix_sharing(), report=lists(1000, counts, 2))
    assert pipelined.pages_held(1000) == 2 * 8 * PAGES_PER_BLOCK and pipelined.blocks_held(1000) == 8


def test_admission_reads_the_settings_once_into_the_record():
    book = core()
    plain = book.admit("plain", KVConfig())
    assert not plain.evicts and plain.publishes and plain.sharing is None
    chunked = book.admit("chunked", settings(kv_evict_every_chunk=True))
    assert chunked.evicts and chunked.admission_cap == 256 + 512 + BS
    turns = book.admit("turns", settings(kv_checkpoint="turns"))
    assert turns.turns.marker == (7, 8, 9)
    assert book.records.keys() == {"plain", "chunked", "turns"}
    cannot = core(evicting=False).admit("x", settings())
    assert cannot.settings.evicts and not cannot.evicts  # served without eviction: the model cannot evict


def test_compact_preempt_and_finish_change_what_the_record_says():
    book = core()
    record = book.admit("r", settings())
    assert record.publishes
    record.spare_taken = 2
    book.compacted(record, lists(600, [256] * PAGES_PER_BLOCK), blocks_freed=5)
    assert record.compacted and not record.publishes and record.spare_taken == 0
    assert record.evicted_tokens(PAGES_PER_BLOCK) == 600 - 256
    book.preempted(record)  # its blocks freed: it recomputes from scratch
    assert not record.compacted and record.evicted_tokens(PAGES_PER_BLOCK) == 0
    assert book.finish("r", 600) is record and book.get("r") is None


def test_a_waiting_request_resumes_from_the_latest_live_checkpoint_and_only_a_live_one():
    book = core()
    config = settings(kv_checkpoint=128)
    record = book.admit("r", config)
    tokens = list(range(1000))
    hashes = [bytes([n]) * 8 for n in range(len(tokens) // BS)]
    progress = Progress(tokens, prompt_tokens=1000, computed=0, block_hashes=hashes)
    cached: dict[bytes, int] = {}
    for position, blocks in ((384, (11, 12)), (640, (21, 22))):
        key = checkpoint_key(hashes[position // BS - 1], config)
        block_hashes = (key + b"0", key + b"1")
        book.published(key, lists(position, [256] * PAGES_PER_BLOCK), blocks, block_hashes)
        cached.update(zip(block_hashes, blocks, strict=True))
    resumed = book.checkpoint_hit(record, progress, cached.get, BS)
    assert resumed.position == 640 and resumed.block_ids == (21, 22)
    assert record.compacted and record.resuming == checkpoint_key(hashes[640 // BS - 1], config)
    del cached[next(key for key, block in cached.items() if block == 22)]  # vLLM reused one of its blocks
    assert book.checkpoint_hit(record, progress, cached.get, BS).position == 384
    assert [key for key, _ in book.checkpoints.prune(cached.get)] == [checkpoint_key(hashes[640 // BS - 1], config)]
    cached.clear()
    assert book.checkpoint_hit(record, progress, cached.get, BS) is None
    assert not record.compacted and record.resuming is None
