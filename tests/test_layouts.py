"""The cache operations of every CPU layout (`kvserve/worker/layouts/`) on ragged page lists whose pages lie anywhere
in a one-head page view, written by vLLM's own cache-write op for that layout: against the PyTorch references of the
kernels (`kvserve_kernels.reference`) and, for "amx", against "vec" holding the same entries (bit for bit wherever
entries are only moved).

vLLM's AMX writer runs on CPUs with AVX-512 (only its AMX attention kernel needs tiles); elsewhere the AMX pages are
written by kvserve's own codec (tests/cache_writers.py), held to vLLM's writer wherever that runs, so every AMX code
path here runs on every machine.

An fp8 cache (`--kv-cache-dtype fp8`) is the same layouts a byte per entry (`QuantisedPages`): its settings run the
same operations on pages vLLM's fp8 writer filled, with scales that are not powers of two, and expect the entries as
`cache_writers.fp8_reference` finds them (a search over the 256 codes, not a conversion). They skip where vLLM has
no fp8 cache (no AVX-512)."""

from __future__ import annotations

import pytest
import torch
from cache_writers import fp8_reference, vllm_cannot_write, vllm_cannot_write_fp8, write, write_with_vllm
from kvserve_kernels.reference import (
    compact_reference,
    decode_attention_reference,
    gather_entries,
    prefill_attention_reference,
)
from vllm import _custom_ops as ops

from kvserve.worker.layouts import (
    FP8_FORMATS,
    AmxPages,
    CachePages,
    QuantisedPages,
    VecPages,
    cpu_views,
    for_cache,
    for_isa,
)

BLOCK, DIM, GROUP = 32, 64, 3
LENGTHS = torch.tensor([75, 40, 96, 1, 33])  # ragged rows: one (request, head) list each
PROB_TOL = dict(rtol=1e-4, atol=1e-6)
FP8_SCALES = (1.3, 1.1)  # k_scale, v_scale: at these a decoded entry re-encodes to another byte (1 in 8 of the codes)
# (layout, model dtype, cache dtype): vLLM stores bf16 in the AMX format only on CPUs with tiles, float32 never; an fp8
# cache keeps the element order of the model dtype's layout
SETTINGS = [
    ("vec", torch.float32, "auto"),
    ("vec", torch.bfloat16, "auto"),
    ("amx", torch.bfloat16, "auto"),
    ("vec", torch.float32, "fp8"),
    ("vec", torch.bfloat16, "fp8_e5m2"),
    ("amx", torch.bfloat16, "fp8_e4m3"),
]
SETTING_IDS = [f"{layout}-{str(dtype).removeprefix('torch.')}-{cache}" for layout, dtype, cache in SETTINGS]
PARAMETERS = "layout,dtype,cache"


def stored(entries: torch.Tensor, cache: str, scale: float) -> torch.Tensor:
    """`entries` as a cache of dtype `cache` reads them back."""
    return entries if cache == "auto" else fp8_reference(entries, FP8_FORMATS[cache], scale)[1]


def page_pool(
    layout: str, dtype: torch.dtype, seed: int = 0, cache: str = "auto"
) -> tuple[CachePages, torch.Tensor, list]:
    """Pages written by vLLM's op in `layout` (and cache dtype), tables [R, W] of distinct pages in shuffled order,
    and each row's (keys, values) [length, D] as the cache reads them back. The same seed gives the same entries in
    every layout."""
    if cache != "auto" and vllm_cannot_write_fp8(layout):
        pytest.skip(vllm_cannot_write_fp8(layout))
    generator = torch.Generator().manual_seed(seed)
    width = -(-int(LENGTHS.max()) // BLOCK)
    num_pages = len(LENGTHS) * width + 3
    tables = torch.randperm(num_pages, generator=generator)[: len(LENGTHS) * width].view(len(LENGTHS), width)
    pages = torch.zeros(num_pages, 1, BLOCK, 2 * DIM, dtype=dtype if cache == "auto" else torch.uint8)
    rows = []
    for row, length in enumerate(LENGTHS.tolist()):
        entries = torch.arange(length)
        keys, values = (torch.randn(length, DIM, generator=generator).to(dtype) for _ in range(2))
        slots = tables[row, entries // BLOCK] * BLOCK + entries % BLOCK
        if cache == "auto":
            write(pages, layout, keys, values, slots)
        else:
            write_with_vllm(pages, layout, keys, values, slots, cache, FP8_SCALES)
        rows.append((stored(keys, cache, FP8_SCALES[0]), stored(values, cache, FP8_SCALES[1])))
    return for_cache(pages, layout, cache, *FP8_SCALES), tables, rows


def vec_twin(cache: CachePages) -> VecPages:
    """The same entries in the "vec" layout (each page decoded and re-stored, unquantised): where the references
    read."""
    if isinstance(cache, VecPages):
        return cache
    ids = torch.arange(cache.pages.shape[0])
    twin = VecPages(torch.zeros(cache.pages.shape, dtype=cache.dtype))
    twin.store_pages(ids, cache.key_pages(ids), cache.value_pages(ids))
    return twin


@pytest.mark.parametrize(PARAMETERS, SETTINGS, ids=SETTING_IDS)
def test_lists_read_back_what_vllm_wrote_and_pad_shorter_rows(layout, dtype, cache):
    cache, tables, rows = page_pool(layout, dtype, cache=cache)
    keys, values = cache.read_lists(tables, LENGTHS)
    for row, (want_k, want_v) in enumerate(rows):
        length = want_k.shape[0]
        assert torch.equal(keys[row, :length], want_k) and torch.equal(values[row, :length], want_v)
        assert not keys[row, length:].any() and not values[row, length:].any()
    vec = vec_twin(cache).views
    for row, length in enumerate(LENGTHS.tolist()):  # and the reference reads the same from the vec views
        want_k, _ = gather_entries(vec.keys, vec.values, tables[row], length)
        assert torch.equal(keys[row, :length], want_k[0])


@pytest.mark.parametrize(PARAMETERS, SETTINGS, ids=SETTING_IDS)
def test_decode_sums_and_first_logits_match_the_reference(layout, dtype, cache):
    cache, tables, _ = page_pool(layout, dtype, seed=1, cache=cache)
    queries = torch.randn(len(LENGTHS), 1, GROUP, DIM).to(dtype)
    sums, first = cache.query_sums(queries, tables, LENGTHS, DIM**-0.5, first_logits=True)
    vec = vec_twin(cache)
    want_sums = torch.zeros(len(LENGTHS), 1, int(LENGTHS.max()))
    want_first = torch.empty(len(LENGTHS), GROUP)
    decode_attention_reference(
        queries[:, 0],
        vec.views.keys,
        vec.views.values,
        tables.int(),
        LENGTHS.int(),
        DIM**-0.5,
        scores=want_sums,
        first_logit=want_first,
        need_output=False,
    )
    torch.testing.assert_close(sums, want_sums[:, 0], **PROB_TOL)
    torch.testing.assert_close(first, want_first, **PROB_TOL)
    torch.testing.assert_close(cache.first_logits(queries[:, 0], tables, DIM**-0.5), first, **PROB_TOL)
    for row, length in enumerate(LENGTHS.tolist()):  # nothing past a row's length, and each row sums to G
        assert not sums[row, length:].any()
        assert abs(float(sums[row].sum()) - GROUP) < 1e-4
    if vec is not cache:  # the vec layout's numbers (AMX multiplies the tiles as stored: another summation order)
        vec_sums, vec_first = vec.query_sums(queries, tables, LENGTHS, DIM**-0.5, first_logits=True)
        torch.testing.assert_close(sums, vec_sums, **PROB_TOL)
        torch.testing.assert_close(first, vec_first, **PROB_TOL)


@pytest.mark.parametrize(
    PARAMETERS, [("vec", torch.float32, "auto"), ("amx", torch.bfloat16, "auto"), ("amx", torch.bfloat16, "fp8")]
)
@pytest.mark.parametrize("with_gain", [False, True])
def test_window_sums_of_a_prefill_chunk_match_the_reference(layout, dtype, cache, with_gain):
    """Each row's newest Q entries are this step's queries; the sums cover the last `window` of them, causally."""
    cache, tables, _ = page_pool(layout, dtype, seed=2, cache=cache)
    vec = vec_twin(cache)
    rows = (LENGTHS > 1).nonzero()[:, 0]  # a one-entry list cannot hold a 20-query chunk
    lengths, tables = LENGTHS[rows], tables[rows]
    chunk, window = 20, 7
    queries = torch.randn(len(rows), chunk, GROUP, DIM)
    gain = 1 + torch.rand(len(rows), window) if with_gain else None
    sums, _ = cache.query_sums(queries[:, -window:], tables, lengths, DIM**-0.5, logit_scale=gain)
    starts = torch.arange(len(rows) + 1, dtype=torch.int32) * chunk

    def reference(window_rows: int, row_scale: torch.Tensor | None = None) -> torch.Tensor:
        _, want, _ = prefill_attention_reference(
            queries.reshape(-1, GROUP, DIM),
            vec.views.keys,
            vec.views.values,
            tables.int(),
            lengths.int(),
            starts,
            DIM**-0.5,
            window_rows,
            score_logit_scale=row_scale,
            need_output=False,
        )
        return want[:, 0]

    row_scale = None
    if with_gain:  # the reference's form: one factor per query token, 1 outside the window
        row_scale = torch.ones(len(rows), chunk)
        row_scale[:, -window:] = gain
        row_scale = row_scale.reshape(1, -1)
    torch.testing.assert_close(sums, reference(window, row_scale), **PROB_TOL)
    # every query chunk of a long prefill lands in the same sums
    all_sums, _ = cache.query_sums(queries, tables, lengths, DIM**-0.5)
    torch.testing.assert_close(all_sums, reference(chunk), **PROB_TOL)


def random_keep(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged kept entries: keep_indices [R, max count] ascending within each row's count, keep_counts [R]."""
    generator = torch.Generator().manual_seed(seed)
    counts = (LENGTHS * 2 // 3).clamp(min=1)
    keep = torch.zeros(len(LENGTHS), int(counts.max()), dtype=torch.long)
    for row, (length, count) in enumerate(zip(LENGTHS.tolist(), counts.tolist(), strict=True)):
        keep[row, :count] = torch.sort(torch.randperm(length, generator=generator)[:count]).values
    return keep, counts


@pytest.mark.parametrize(PARAMETERS, SETTINGS, ids=SETTING_IDS)
def test_compaction_matches_the_reference_bit_for_bit(layout, dtype, cache):
    cache, tables, rows = page_pool(layout, dtype, seed=3, cache=cache)
    keep, counts = random_keep(3)
    stats = torch.randn(len(LENGTHS), int(LENGTHS.max()), generator=torch.Generator().manual_seed(4))
    want = vec_twin(cache)
    want = VecPages(want.pages.clone())
    want_stats = stats.clone()
    compact_reference(
        want.views.keys, want.views.values, tables.int(), keep[:, None], keep_counts=counts, stats=[want_stats[:, None]]
    )
    before = cache.pages.clone()
    if isinstance(cache, QuantisedPages):  # what the layout stores, bytes for fp8
        stored_keys, stored_values = cache.stored.read_rows(tables, int(LENGTHS.max()))
    cache.compact(tables, keep, counts, stats=[stats])
    assert torch.equal(stats, want_stats)
    assert torch.equal(vec_twin(cache).pages, want.pages)
    if isinstance(cache, QuantisedPages):  # a kept entry moved as its bytes, not decoded and encoded again
        got_keys, got_values = cache.stored.read_rows(tables, int(counts.max()))
        for row, count in enumerate(counts.tolist()):
            kept = keep[row, :count]
            assert torch.equal(got_keys[row, :count], stored_keys[row, kept])
            assert torch.equal(got_values[row, :count], stored_values[row, kept])
    elif layout == "amx":  # the kept entries' pages are what vLLM's AMX writer writes for them, bit for bit
        fresh = torch.zeros_like(cache.pages)
        for row, count in enumerate(counts.tolist()):
            entries = torch.arange(count)
            kept = keep[row, :count]
            slots = tables[row, entries // BLOCK] * BLOCK + entries % BLOCK
            write(fresh, "amx", rows[row][0][kept], rows[row][1][kept], slots)
        full_pages = [int(tables[row, 0]) for row, count in enumerate(counts.tolist()) if count >= BLOCK]
        assert full_pages and torch.equal(cache.pages[full_pages], fresh[full_pages])
    # a page that holds no kept entry afterwards is never written (other lists' pages, the tails of these lists)
    written = {int(page) for row, count in enumerate(counts.tolist()) for page in tables[row, : -(-count // BLOCK)]}
    for page in set(range(cache.pages.shape[0])) - written:
        assert torch.equal(cache.pages[page], before[page])


@pytest.mark.parametrize(PARAMETERS, SETTINGS, ids=SETTING_IDS)
def test_writes_land_where_the_reads_find_them(layout, dtype, cache):
    cache_dtype = cache
    cache, tables, _ = page_pool(layout, dtype, seed=5, cache=cache)
    generator = torch.Generator().manual_seed(6)
    width = 50
    keys, values = (torch.randn(len(LENGTHS), width, DIM, generator=generator).to(dtype) for _ in range(2))
    cache.write_lists(tables, keys, values)
    keys, values = stored(keys, cache_dtype, FP8_SCALES[0]), stored(values, cache_dtype, FP8_SCALES[1])
    got_k, got_v = cache.read_rows(tables, width)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    slots = torch.tensor([int(tables[0, 1]) * BLOCK + 3, int(tables[2, 0]) * BLOCK + 31, int(tables[0, 1]) * BLOCK])
    new_k, new_v = (torch.randn(3, DIM, generator=generator).to(dtype) for _ in range(2))
    cache.write_slots(slots, new_k, new_v)
    got_k, got_v = cache.read_rows(tables, width)
    keys[0, BLOCK + 3], keys[2, 31], keys[0, BLOCK] = stored(new_k, cache_dtype, FP8_SCALES[0])
    values[0, BLOCK + 3], values[2, 31], values[0, BLOCK] = stored(new_v, cache_dtype, FP8_SCALES[1])
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    if layout != "vec" or cache_dtype != "auto":  # and vLLM's own writer puts the same bytes there
        by_vllm = cache.pages.clone()
        if cache_dtype == "auto":
            write(by_vllm, layout, new_k, new_v, slots)
        else:
            write_with_vllm(by_vllm, layout, new_k, new_v, slots, cache_dtype, FP8_SCALES)
        assert torch.equal(by_vllm, cache.pages)


@pytest.mark.parametrize(PARAMETERS, SETTINGS, ids=SETTING_IDS)
def test_a_page_move_copies_the_page_without_decoding_it(layout, dtype, cache):
    cache, tables, _ = page_pool(layout, dtype, seed=7, cache=cache)
    source, destination, bystander = int(tables[0, 0]), int(tables[1, 1]), int(tables[2, 2])
    before = cache.pages[bystander].clone()
    want_k, want_v = cache.key_pages(torch.tensor([source])), cache.value_pages(torch.tensor([source]))
    cache.copy_pages([(source, destination)])
    assert torch.equal(cache.key_pages(torch.tensor([destination])), want_k)
    assert torch.equal(cache.value_pages(torch.tensor([destination])), want_v)
    assert torch.equal(cache.pages[bystander], before)
    assert torch.equal(cache.pages[destination], cache.pages[source])


@pytest.mark.parametrize("block_size,dim", [(32, 64), (128, 64), (64, 128)])
def test_amx_pages_decode_and_encode_as_vllms_writer(block_size, dim):
    if vllm_cannot_write("amx"):
        pytest.skip(vllm_cannot_write("amx"))
    heads, n, block_ids = 3, 2 * block_size + 7, [3, 0, 1]
    keys, values = torch.randn(n, heads, dim).bfloat16(), torch.randn(n, heads, dim).bfloat16()
    kv_cache = torch.zeros(4, heads, block_size, 2 * dim, dtype=torch.bfloat16)
    key_cache, value_cache = kv_cache.view(4, heads, 2 * block_size, dim).chunk(2, dim=2)
    slots = torch.tensor([block_ids[t // block_size] * block_size + t % block_size for t in range(n)])
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, slots, "amx", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    pages = AmxPages(kv_cache.view(4 * heads, 1, block_size, 2 * dim))  # page b * heads + h: block b, head h
    ids = torch.arange(4 * heads)
    page_keys, page_values = pages.key_pages(ids).transpose(1, 2), pages.value_pages(ids)  # [pages, bs, D]
    tokens = torch.arange(n)
    for head in range(heads):
        page = torch.tensor(block_ids)[tokens // block_size] * heads + head
        assert torch.equal(page_keys[page, tokens % block_size], keys[:, head])
        assert torch.equal(page_values[page, tokens % block_size], values[:, head])
    encoded = AmxPages(torch.zeros_like(pages.pages))
    encoded.store_pages(ids, page_keys.transpose(1, 2), page_values)
    assert torch.equal(encoded.pages, pages.pages)


def test_cpu_views_read_what_vllms_vec_writer_wrote():
    pages = torch.zeros(2, 1, BLOCK, 2 * DIM)
    keys, values = torch.randn(5, DIM), torch.randn(5, DIM)
    slots = torch.tensor([0, 1, BLOCK + 4, BLOCK + 5, 7])
    write(pages, "vec", keys, values, slots)
    views = cpu_views(pages)
    assert torch.equal(views.keys[slots // BLOCK, slots % BLOCK, 0], keys)
    assert torch.equal(views.values[slots // BLOCK, slots % BLOCK, 0], values)


def test_an_unknown_isa_is_refused_by_name():
    with pytest.raises(RuntimeError, match="'neon'"):
        for_isa("neon")
    assert for_isa("amx") is AmxPages and for_isa("vec") is VecPages


def decoding_plans(layout: str, heads: int = 3):
    """Three evicting requests decoding one token each in one layer (h2o, mat, ems), over a page view."""
    from kvserve.config import parse_kv_config
    from kvserve.worker.pages import HeadPages, PageLayout
    from kvserve.worker.request import WorkerRequest
    from kvserve.worker.step import RowPlan

    page_layout = PageLayout(num_layers=1, num_blocks=8, num_heads=heads, block_size=BLOCK)
    dtype = torch.bfloat16 if layout == "amx" else torch.float32
    cache = for_isa(layout)(torch.randn(page_layout.num_blocks * heads, 1, BLOCK, 2 * DIM).to(dtype))
    plans = []
    for row, (policy, blocks, tokens) in enumerate([("h2o", [1, 4], 50), ("mat", [6], 20), ("ems", [2, 3, 7], 70)]):
        config = parse_kv_config({"kv_policy": policy, "kv_budget": 64}, defaults={})
        state = WorkerRequest(config=config, policy=config.make_policy(), pages=HeadPages(page_layout))
        state.pages.add_blocks(blocks)
        state.pages.append(tokens)
        plans.append(
            RowPlan(
                req_id=str(row),
                state=state,
                row=row,
                query_start=row,
                query_end=row + 1,
                logical_len=tokens,
                compaction=None,
            )
        )
    query = torch.randn(len(plans), heads * GROUP, DIM).to(dtype)
    return plans, cache, query


@pytest.mark.parametrize("layout", ["vec", "amx"])
def test_a_failing_batched_pass_falls_back_to_each_request_alone(layout, monkeypatch):
    from kvserve.worker import eviction
    from kvserve.worker.step import StepContext

    def run_step() -> list:
        torch.manual_seed(5)  # the same requests, cache and queries each time
        plans, cache, query = decoding_plans(layout)
        tables = {plan.req_id: plan.table(0) for plan in plans}
        eviction.after_attention(
            StepContext(pages=None, rows=plans), 0, query, cache, tables, DIM**-0.5, torch.empty_like(query)
        )
        return plans

    batched = run_step()

    def broken(*args, **kwargs):
        raise RuntimeError("batched pass broke")

    monkeypatch.setattr(eviction, "measure_decode_rows", broken)
    alone = run_step()
    assert all(plan.failure is None for plan in alone)  # nobody failed, the engine went on
    for with_batch, without in zip(batched, alone, strict=True):
        want, got = with_batch.state.layer(0).stats, without.state.layer(0).stats
        assert want.keys() == got.keys() and want
        for name in want:
            torch.testing.assert_close(got[name], want[name], **PROB_TOL)


@pytest.mark.parametrize("layout", ["vec", "amx"])
def test_one_product_for_all_decoding_requests_equals_each_request_alone(layout):
    """`measure_decode_rows` measures every decoding request of a layer at once (lists of different lengths, policies
    wanting different statistics); each request gets what `measure_pass` measures for it alone."""
    from kvserve.worker import eviction
    from kvserve.worker.step import StepContext

    plans, cache, query = decoding_plans(layout)
    tables = {plan.req_id: plan.table(0) for plan in plans}
    batched = eviction.measure_decode_rows(StepContext(pages=None, rows=plans), 0, query, cache, tables, DIM**-0.5)
    assert set(batched) == {"0", "1", "2"}
    for plan in plans:
        lengths = plan.lengths(0)
        obs = eviction._observe(plan, plan.state.layer(0), 0, cache, lengths, DIM**-0.5)
        alone = eviction.measure_pass(
            plan.state.policy,
            obs,
            query[plan.query_start : plan.query_end],
            cache,
            tables[plan.req_id],
            lengths,
            compacting=False,
        )
        for name in ("column_sums", "first_logits"):
            want, got = getattr(alone, name), getattr(batched[plan.req_id], name)
            assert (want is None) == (got is None) == (name not in plan.state.policy.pass_statistics)
            if want is not None:
                torch.testing.assert_close(got, want, **PROB_TOL)


@pytest.mark.parametrize("layout", ["vec", "amx"])
def test_folding_the_pass_statistics_equals_the_policys_own_update(layout, monkeypatch):
    """A decode step of H2O, EMS or MAT adds the pass's numbers to the running statistic without building an
    observation (`fold_pass_statistics`); the statistics are those `update_stats` computes through one."""
    from kvserve.worker import eviction
    from kvserve.worker.step import StepContext

    folds = []
    fold = eviction.fold_pass_statistics
    monkeypatch.setattr(eviction, "fold_pass_statistics", lambda *args: folds.append(args) or fold(*args))

    def run_step() -> list:
        torch.manual_seed(7)
        plans, cache, query = decoding_plans(layout)
        for plan in plans:  # what earlier steps left: one entry short of this step's lists
            width = int(plan.state.pages.lens[0].max()) - 1
            plan.state.layer(0).stats = {name: torch.rand(3, width) for name in plan.state.policy.stat_names}
        tables = {plan.req_id: plan.table(0) for plan in plans}
        step = StepContext(pages=None, rows=plans)
        eviction.after_attention(step, 0, query, cache, tables, DIM**-0.5, torch.empty_like(query))
        return plans

    folded = run_step()
    assert len(folds) == 3
    monkeypatch.setattr(eviction, "fold_pass_statistics", lambda *args: None)
    observed = run_step()
    for with_fold, without in zip(folded, observed, strict=True):
        want, got = without.state.layer(0).stats, with_fold.state.layer(0).stats
        assert want.keys() == got.keys() and want
        for name in want:
            torch.testing.assert_close(got[name], want[name], **PROB_TOL)


@pytest.mark.parametrize("cache", sorted(FP8_FORMATS))
def test_the_fp8_codec_stores_what_vllms_writer_stores(cache):
    """Encoding is vLLM's writer's (rounding toward zero, saturating), decoding gives the value times the scale;
    both held to the search reference over wide and tiny magnitudes."""
    if vllm_cannot_write_fp8("vec"):
        pytest.skip(vllm_cannot_write_fp8("vec"))
    generator = torch.Generator().manual_seed(8)
    count = 4 * BLOCK
    spread = torch.logspace(-6, 3, count)[:, None]  # from below the smallest subnormal to past e4m3's largest value
    keys, values = (torch.randn(count, DIM, generator=generator) * spread for _ in range(2))
    pages = torch.zeros(4, 1, BLOCK, 2 * DIM, dtype=torch.uint8)
    write_with_vllm(pages, "vec", keys, values, torch.arange(count), cache, FP8_SCALES)
    by_vllm = VecPages(pages)
    quantised = for_cache(torch.zeros_like(pages), "vec", cache, *FP8_SCALES)
    assert isinstance(quantised, QuantisedPages)
    codec, ids = quantised.codec, torch.arange(4)
    stored_keys = by_vllm.key_pages(ids).transpose(1, 2).reshape(count, DIM)
    stored_values = by_vllm.value_pages(ids).reshape(count, DIM)
    assert torch.equal(codec.encode(keys, FP8_SCALES[0]), stored_keys)
    assert torch.equal(codec.encode(values, FP8_SCALES[1]), stored_values)
    codes, readback = fp8_reference(keys, FP8_FORMATS[cache], FP8_SCALES[0])
    assert torch.equal(codes, stored_keys)
    quantised.write_slots(torch.arange(count), keys, values)
    assert torch.equal(quantised.pages, pages)
    assert torch.equal(quantised.read_rows(torch.arange(4)[None], count)[0][0], readback)


def test_an_unknown_cache_dtype_is_refused_by_name():
    with pytest.raises(RuntimeError, match="'int8'"):
        for_cache(torch.zeros(1, 1, BLOCK, 2 * DIM, dtype=torch.uint8), "vec", "int8")
