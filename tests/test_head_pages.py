"""Head-granular pages: the contract with vLLM 0.32's own CPU ops that the page path stands on, and the page
bookkeeping (allocation, compaction, block release, the scheduler's page demand) under a seeded fuzz.

The contract (kvserve/worker/pages.py, kvserve/worker/step.py): vLLM's allocator puts every layer in one buffer, which
views as [L * NB * H, 1, bs, 2D] pages; `cpu_attention_with_kv_cache` called on pseudo-sequences (one row per
(KV head, request), one KV head, G query heads) over that view equals the normal call bit for bit, and with ragged
lengths and pages anywhere it equals a PyTorch reference; `cpu_attn_reshape_and_cache` writes through the view.
A vLLM release that breaks any of this fails here first.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvserve.messages import pages_needed
from kvserve.worker.eviction import pseudo_queries
from kvserve.worker.pages import (
    HeadPages,
    PageLayout,
    blocks_to_release,
    cdiv,
    check_cache_contract,
    page_view,
)

AMX = torch.cpu._is_amx_tile_supported()
ISAS = [
    pytest.param("vec", torch.float32, id="vec-fp32"),
    pytest.param("vec", torch.bfloat16, id="vec-bf16"),
    pytest.param(
        "amx", torch.bfloat16, id="amx-bf16", marks=pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles")
    ),
]
LAYERS, BLOCKS, HEADS, BS, DIM, GROUP = 3, 24, 2, 32, 64, 3


def vllm_caches(dtype: torch.dtype) -> list[torch.Tensor]:
    """Per-layer caches exactly as vLLM 0.32's worker allocates them (one KVCacheTensor, layout LBHNC)."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, KVCacheLayout.LBHNC)
    config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        kv_cache_tensors=[
            KVCacheTensor(
                size=LAYERS * BLOCKS * spec.page_size_bytes,
                layers=names,
                layer_stride=layer_stride,
                block_stride=block_stride,
            )
        ],
    )
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, [BS])
    return [caches[name] for name in names]


def split(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # as CPUAttentionBackendImpl.forward does
    return cache.view(cache.shape[0], cache.shape[1], 2 * cache.shape[2], -1).chunk(2, dim=2)


def attend(isa, query, key_cache, value_cache, query_start_loc, seq_lens, table, num_kv_heads) -> torch.Tensor:
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(),
        num_heads=query.shape[1],
        num_kv_heads=num_kv_heads,
        head_dim=DIM,
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=True,
    )
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=DIM**-0.5,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=table,
        softcap=0.0,
        scheduler_metadata=metadata,
        s_aux=None,
    )
    return out


def test_vllms_allocation_is_one_buffer_that_views_as_pages():
    caches = vllm_caches(torch.float32)
    layout = check_cache_contract(caches)
    assert layout == PageLayout(LAYERS, BLOCKS, HEADS, BS)
    pages = page_view(caches, layout)
    for layer in range(LAYERS):
        caches[layer][5, 1, 3, 7] = 100.0 + layer
        assert pages[layout.page_id(layer, 5, 1), 0, 3, 7] == 100.0 + layer


def test_a_cache_that_is_not_one_layer_outermost_buffer_is_refused_with_the_reason():
    separate = [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
    with pytest.raises(RuntimeError, match="layer 1 lives in another buffer"):
        check_cache_contract(separate)


@pytest.mark.parametrize("isa,dtype", ISAS)
def test_pseudo_sequences_over_the_page_view_equal_vllms_normal_call(isa, dtype):
    """A mixed batch (a prefill chunk of 40 over 70, a decode over 50, a 33-token prefill), each layer: the pseudo
    call through the page view of the whole buffer gives vLLM's own output, bit for bit."""
    torch.manual_seed(0)
    caches = vllm_caches(dtype)
    layout = check_cache_contract(caches)
    page_keys, page_values = split(page_view(caches, layout))
    seq_lens = torch.tensor([70, 50, 33], dtype=torch.int32)
    query_lens = torch.tensor([40, 1, 33], dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).to(torch.int32)])
    tokens, reqs = int(starts[-1]), 3
    order = torch.randperm(BLOCKS).tolist()
    blocks = [order[0:3], order[3:5], order[5:7]]
    table = torch.zeros(reqs, 3, dtype=torch.int32)
    for r, ids in enumerate(blocks):
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    for layer in range(LAYERS):
        key_cache, value_cache = split(caches[layer])
        slots = torch.cat(
            [torch.tensor([blocks[r][t // BS] * BS + t % BS for t in range(int(seq_lens[r]))]) for r in range(reqs)]
        )
        keys = torch.randn(slots.numel(), HEADS, DIM).to(dtype)
        ops.cpu_attn_reshape_and_cache(keys, torch.randn_like(keys), key_cache, value_cache, slots, isa)
        query = torch.randn(tokens, HEADS * GROUP, DIM).to(dtype)
        normal = attend(isa, query, key_cache, value_cache, starts, seq_lens, table, HEADS)
        pseudo_table = torch.cat([layout.page_id(layer, table, h) for h in range(HEADS)]).to(torch.int32)
        pseudo_starts = torch.cat(
            [torch.cat([starts[:-1] + h * tokens for h in range(HEADS)]), torch.tensor([HEADS * tokens])]
        ).to(torch.int32)
        out = attend(
            isa,
            pseudo_queries(query, HEADS),
            page_keys,
            page_values,
            pseudo_starts,
            seq_lens.repeat(HEADS),
            pseudo_table,
            1,
        )
        assert torch.equal(out.view(HEADS, tokens, GROUP, DIM).transpose(0, 1).reshape_as(normal), normal)


@pytest.mark.parametrize("isa,dtype", ISAS)
def test_ragged_lists_with_pages_anywhere_match_a_pytorch_reference(isa, dtype):
    """Every (layer, head, request) with its own length and pages drawn from the whole pool (other layers'
    regions included), written through the page view by vLLM's writer, read by the pseudo call."""
    torch.manual_seed(1)
    caches = vllm_caches(dtype)
    layout = check_cache_contract(caches)
    page_keys, page_values = split(page_view(caches, layout))
    free = torch.randperm(LAYERS * BLOCKS * HEADS).tolist()
    new_tokens = torch.tensor([1, 5, 1], dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), new_tokens.cumsum(0).to(torch.int32)])
    tokens, reqs = int(starts[-1]), 3
    for _layer in range(LAYERS):
        lengths = torch.randint(0, 90, (HEADS, reqs)) + new_tokens[None]
        table = torch.zeros(HEADS * reqs, 3, dtype=torch.int32)
        keys = {}
        values = {}
        slots = []
        for h in range(HEADS):
            for r in range(reqs):
                n = int(lengths[h, r])
                pages = [free.pop() for _ in range(cdiv(n, BS))]
                table[h * reqs + r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
                keys[h, r], values[h, r] = torch.randn(n, DIM).to(dtype), torch.randn(n, DIM).to(dtype)
                slots.append([pages[t // BS] * BS + t % BS for t in range(n)])
        # history per list, then this step's tokens in one [T*H, 1, D] call ordered (token, head)
        for h in range(HEADS):
            for r in range(reqs):
                old = int(lengths[h, r]) - int(new_tokens[r])
                if old:
                    ops.cpu_attn_reshape_and_cache(
                        keys[h, r][:old, None],
                        values[h, r][:old, None],
                        page_keys,
                        page_values,
                        torch.tensor(slots[h * reqs + r][:old]),
                        isa,
                    )
        step_keys, step_values, step_slots = [], [], []
        for r in range(reqs):
            for i in range(int(new_tokens[r])):
                for h in range(HEADS):
                    at = int(lengths[h, r]) - int(new_tokens[r]) + i
                    step_keys.append(keys[h, r][at])
                    step_values.append(values[h, r][at])
                    step_slots.append(slots[h * reqs + r][at])
        ops.cpu_attn_reshape_and_cache(
            torch.stack(step_keys)[:, None],
            torch.stack(step_values)[:, None],
            page_keys,
            page_values,
            torch.tensor(step_slots),
            isa,
        )
        query = torch.randn(tokens, HEADS * GROUP, DIM).to(dtype)
        pseudo_starts = torch.cat(
            [torch.cat([starts[:-1] + h * tokens for h in range(HEADS)]), torch.tensor([HEADS * tokens])]
        ).to(torch.int32)
        out = attend(
            isa,
            pseudo_queries(query, HEADS),
            page_keys,
            page_values,
            pseudo_starts,
            lengths.reshape(-1).to(torch.int32),
            table,
            1,
        )
        out = out.view(HEADS, tokens, GROUP, DIM).transpose(0, 1)
        for r in range(reqs):
            a, b = int(starts[r]), int(starts[r + 1])
            for h in range(HEADS):
                n = int(lengths[h, r])
                q = query[a:b].view(b - a, HEADS, GROUP, DIM)[:, h].float()
                logits = torch.einsum("qgd,nd->qgn", q, keys[h, r].float()) * DIM**-0.5
                own = torch.arange(n - (b - a), n)
                logits = logits.masked_fill(torch.arange(n)[None, None, :] > own[:, None, None], float("-inf"))
                want = torch.einsum("qgn,nd->qgd", logits.softmax(-1), values[h, r].float())
                tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
                assert (out[a:b, h].float() - want).abs().max() < tolerance, (r, h)


# --------------------------------------------------------------------------------------------------------------------
# Page bookkeeping under a seeded fuzz: allocate (as the scheduler grants blocks), append, compact to ragged counts,
# release blocks (moving live pages), preempt. Page "contents" are tags that the moves carry.
# --------------------------------------------------------------------------------------------------------------------

FUZZ_LAYOUT = PageLayout(num_layers=4, num_blocks=64, num_heads=3, block_size=8)


def _check(lists: HeadPages, contents: dict[int, tuple[int, int, int]]) -> None:
    layout = lists.layout
    counts = lists.page_counts()
    assert lists.pages_in_use == int(counts.sum())
    in_lists = [
        int(lists.table[lay, h, i])
        for lay in range(layout.num_layers)
        for h in range(layout.num_heads)
        for i in range(int(counts[lay, h]))
    ]
    assert len(set(in_lists)) == len(in_lists)  # no page in two lists
    assert {int(layout.block_of(page)) for page in in_lists} <= set(lists.blocks)  # only the request's blocks
    for lay in range(layout.num_layers):
        for h in range(layout.num_heads):
            for i in range(int(counts[lay, h])):
                assert contents[int(lists.table[lay, h, i])] == (lay, h, i)  # moved pages kept their entries


@pytest.mark.parametrize("seed", range(6))
def test_page_accounting_fuzz(seed):
    rng = random.Random(seed)
    layout = FUZZ_LAYOUT
    free_blocks = list(range(1, layout.num_blocks))
    lists = HeadPages(layout)
    contents: dict[int, tuple[int, int, int]] = {}
    logical = 0
    for _ in range(60):
        action = rng.choice(["append", "append", "compact", "preempt"] if logical else ["append"])
        if action == "preempt":
            free_blocks += lists.blocks
            lists, contents, logical = HeadPages(layout), {}, 0
            continue
        if action == "append":
            tokens = rng.choice([1, 1, 3, 8, 17])
            need = pages_needed(lists.free_slot_counts(), tokens)  # what the scheduler charges
            assert lists.stage_pages().pages_after(tokens) == lists.pages_in_use + need  # its report's shortcut
            blocks = cdiv(lists.pages_in_use + need, layout.pages_per_block)
            grant = [free_blocks.pop(rng.randrange(len(free_blocks))) for _ in range(blocks - len(lists.blocks))]
            lists.add_blocks(grant)
            before = lists.pages_in_use
            old = lists.page_counts()
            lists.append(tokens)
            assert lists.pages_in_use - before == need
            new = lists.page_counts()
            for lay, h in np.argwhere(new > old):
                for i in range(old[lay, h], new[lay, h]):
                    contents[int(lists.table[lay, h, i])] = (int(lay), int(h), int(i))
            logical += tokens
        else:
            for layer in range(layout.num_layers):
                counts = np.array([rng.randint(0, int(n)) for n in lists.lens[layer]])
                lists.shrink(layer, counts)
            moves, released = lists.release_blocks()
            for source, destination in moves:
                contents[destination] = contents.pop(source)
            assert len(lists.blocks) == cdiv(lists.pages_in_use, layout.pages_per_block)
            assert not set(released) & set(lists.blocks)
            free_blocks += released
        _check(lists, contents)
    assert len(free_blocks) + len(lists.blocks) == layout.num_blocks - 1  # nothing leaked


def test_lists_that_keep_the_same_count_use_vllms_own_slots_and_free_tail_blocks_without_moves():
    layout = FUZZ_LAYOUT
    lists = HeadPages(layout)
    lists.add_blocks([9, 4, 30, 12])
    slots = lists.append(30)
    for lay in range(layout.num_layers):
        for h in range(layout.num_heads):
            pages = [layout.page_id(lay, b, h) for b in (9, 4, 30, 12)]
            assert slots[lay, h].tolist() == [pages[t // 8] * 8 + t % 8 for t in range(30)]
    for layer in range(layout.num_layers):
        lists.shrink(layer, np.array([12, 12, 12]))
    moves, released = lists.release_blocks()
    assert moves == [] and released == [30, 12] and lists.blocks == [9, 4]


@pytest.mark.parametrize("seed", range(4))
def test_rejected_drafts_leave_and_their_slots_are_the_next_steps(seed):
    """Speculative decoding: a step appends its token and drafts; the rejected drafts are truncated; the next step
    appends into the slots a step without those drafts would have used, and pages emptied by the truncation are
    free again."""
    rng = random.Random(seed)
    layout = FUZZ_LAYOUT
    drafted, plain = HeadPages(layout), HeadPages(layout)
    for lists in (drafted, plain):
        lists.add_blocks(list(range(20, 50)))
        lists.append(13)
    for layer in range(layout.num_layers):  # compacted: the heads hold different counts
        counts = np.array([rng.randint(1, 13) for _ in range(layout.num_heads)])
        drafted.shrink(layer, counts)
        plain.shrink(layer, counts)
    for _ in range(12):
        drafts = rng.randint(1, 9)
        accepted = rng.randint(0, drafts)
        drafted.append(1 + drafts)
        drafted.truncate(drafts - accepted)
        plain.append(1 + accepted)
        assert (drafted.lens == plain.lens).all() and drafted.pages_in_use == plain.pages_in_use
        assert (drafted.used == plain.used).all()
        assert (drafted.append(1) == plain.append(1)).all()  # the same slots from here on


@pytest.mark.parametrize("seed", range(4))
def test_pipeline_stages_give_back_the_same_blocks_and_keep_their_entries(seed):
    """Two pipeline stages hold different layers' pages in the same blocks: the blocks chosen from both stages'
    counts are empty on both after each moves its pages, each keeps what its lists held, and every stage fits."""
    rng = random.Random(seed)
    stages = [PageLayout(num_layers=layers, num_blocks=64, num_heads=3, block_size=8) for layers in (3, 2)]
    free_blocks = list(range(1, 64))
    lists = [HeadPages(layout) for layout in stages]
    contents: list[dict[int, tuple[int, int, int]]] = [{}, {}]
    for _ in range(25):
        tokens = rng.choice([1, 5, 8, 19])
        blocks = max(
            cdiv(stage.pages_in_use + pages_needed(stage.free_slot_counts(), tokens), stage.layout.pages_per_block)
            for stage in lists
        )
        grant = [free_blocks.pop(rng.randrange(len(free_blocks))) for _ in range(blocks - len(lists[0].blocks))]
        for stage, content in zip(lists, contents, strict=True):
            stage.add_blocks(grant)
            old = stage.page_counts()
            stage.append(tokens)
            for lay, h in np.argwhere(stage.page_counts() > old):
                for i in range(old[lay, h], stage.page_counts()[lay, h]):
                    content[int(stage.table[lay, h, i])] = (int(lay), int(h), int(i))
        if rng.random() < 0.5:
            continue
        for stage in lists:  # ragged counts, different on each stage
            for layer in range(stage.layout.num_layers):
                stage.shrink(layer, np.array([rng.randint(0, int(n)) for n in stage.lens[layer]]))
        released = blocks_to_release(
            list(lists[0].blocks),
            [(stage.pages_in_use, stage.layout.pages_per_block, stage.live_pages()) for stage in lists],
        )
        for stage, content in zip(lists, contents, strict=True):
            for source, destination in stage.release(released):
                content[destination] = content.pop(source)
            assert stage.blocks == lists[0].blocks and not set(released) & set(stage.blocks)
            _check(stage, content)
        assert len(lists[0].blocks) == max(cdiv(stage.pages_in_use, stage.layout.pages_per_block) for stage in lists)
        free_blocks += released
    assert len(free_blocks) + len(lists[0].blocks) == 63  # nothing leaked
