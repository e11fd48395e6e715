"""The Triton kernels of `kvserve_kernels` (kernels/) against their PyTorch references, and the references against
a plain dense computation from the logical keys and values.

Without a GPU the kernels run under Triton's interpreter on a small grid; with a GPU they are compiled and the grid is
larger. TRITON_INTERPRET=1 is set while the kernel modules are imported (their @triton.jit decorators read it then)
and again, by an autouse fixture, during each test of this module (the interpreter reads it at launch), and is
restored in between, so that the vLLM processes other tests start do not inherit it.

Tolerances (kernel vs reference, both from the same cache): fp32 rtol 1e-4 / atol 1e-5 on outputs; fp16 and bf16
rtol = atol = 2e-2 on outputs (stored in half, probabilities rounded to half before P.V, as every flash kernel does);
probabilities, scores, window sums and logits are fp32 in both and compared at rtol 1e-3 / atol 1e-5 for every dtype
(q.k products of half inputs are exact in fp32; only the summation order differs).
"""

from __future__ import annotations

import functools
import importlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _import_kernels():
    """Import (or re-import) the kernel modules with TRITON_INTERPRET=1 on CPU, then restore the environment."""
    saved = os.environ.get("TRITON_INTERPRET")
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        try:
            import triton  # noqa: F401
        except Exception as exc:  # not installed, or it fails to initialise: skip, with the reason
            pytest.skip(
                f"Triton cannot be imported ({type(exc).__name__}: {exc}); the kernel tests need it "
                "(interpreter mode on CPU)",
                allow_module_level=True,
            )
        # the jit helpers the kernels call live in _common: it must be interpreted too, and first
        common = importlib.import_module("kvserve_kernels._common")
        if not CUDA and type(common.load_kv_tile).__name__ != "InterpretedFunction":
            common = importlib.reload(common)
        modules = []
        for name in ("compaction", "decode_attention", "prefill_window"):  # a packaging error fails, not skips
            module = importlib.import_module(f"kvserve_kernels.{name}")
            kernels = [obj for key, obj in vars(module).items() if key.endswith("_kernel")]
            stale_helper = getattr(module, "load_kv_tile", common.load_kv_tile) is not common.load_kv_tile
            if not CUDA and (type(kernels[0]).__name__ != "InterpretedFunction" or stale_helper):
                module = importlib.reload(module)  # imported before, uninterpreted
            modules.append(module)
        return modules
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
compaction, decode_attention, prefill_window = _import_kernels()

from kvserve_kernels import reference  # noqa: E402
from kvserve_kernels.layout import new_kv_cache, split_kv_cache  # noqa: E402

from kvserve.policies import POLICIES, representative_policies  # noqa: E402
from kvserve.policies.rotary import Rotary  # noqa: E402
from kvserve.worker import kernel_dispatch  # noqa: E402

_INTERPRET_AFTER_IMPORT = os.environ.get("TRITON_INTERPRET")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    """Triton's interpreter reads TRITON_INTERPRET again when it launches; set it for each test of this module only."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 2), (2, 2)] + ([(8, 1), (8, 2)] if CUDA else [])  # (query heads, KV heads)
BLOCK_SIZES = [16, 32] + ([64] if CUDA else [])
HEAD_DIM = 32
SEQ_LENS = [1, 17, 45] + ([300, 1030] if CUDA else [])  # cross block boundaries of 16 and 32
SPLITS = [1, 3] + ([None] if CUDA else [])  # None: the kernel's own split count and tile sizes
HEAD_DIMS = [HEAD_DIM] + ([128, 80] if CUDA else [])


def out_tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


PROB_TOL = dict(rtol=1e-3, atol=1e-5)


def make_cache(lens, num_kv_heads, block_size, dtype, layout="LBNHC", seed=0, head_dim=HEAD_DIM):
    """A cache holding len(lens) requests: logical keys/values [n, Hkv, D] per request, written slot by slot through
    a shuffled block table (with spare blocks nobody owns).

    Returns (kv, key_cache, value_cache, block_table, seq_lens, [(keys, values) per request, fp32 on CPU]).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // block_size) for n in lens]
    width = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 3
    kv = new_kv_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype, DEVICE, layout)
    kv.copy_(torch.randn(kv.shape, generator=gen).to(dtype))
    key_cache, value_cache = split_kv_cache(kv, head_dim)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    logical = []
    for r, n in enumerate(lens):
        for b in range(blocks_per_req[r]):
            table[r, b] = order.pop()
        keys = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for i in range(n):
            block, offset = int(table[r, i // block_size]), i % block_size
            key_cache[block, offset] = keys[i].to(DEVICE)
            value_cache[block, offset] = values[i].to(DEVICE)
        logical.append((keys.float(), values.float()))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return kv, key_cache, value_cache, table.to(DEVICE), seq_lens, logical


# ---- references against plain dense attention (independent of the block-table gather) ----


def test_decode_reference_matches_dense_attention():
    lens, hq, hkv = [5, 33], 4, 2
    _, k, v, table, seq_lens, logical = make_cache(lens, hkv, 16, torch.float32)
    q = torch.randn(len(lens), hq, HEAD_DIM, device=DEVICE)
    scores = torch.zeros(len(lens), hkv, 40, device=DEVICE)
    last = torch.zeros_like(scores)
    first = torch.zeros(len(lens), hq, device=DEVICE)
    out, _ = reference.decode_attention_reference(
        q, k, v, table, seq_lens, 0.2, scores=scores, last_probs=last, first_logit=first
    )
    for r, (keys, values) in enumerate(logical):
        kk = keys.repeat_interleave(hq // hkv, dim=1).to(DEVICE)  # [n, Hq, D]
        vv = values.repeat_interleave(hq // hkv, dim=1).to(DEVICE)
        logits = torch.einsum("hd,nhd->hn", q[r], kk) * 0.2
        probs = torch.softmax(logits, dim=-1)
        torch.testing.assert_close(out[r], torch.einsum("hn,nhd->hd", probs, vv), rtol=1e-5, atol=1e-5)
        grouped = probs.reshape(hkv, hq // hkv, -1)
        torch.testing.assert_close(scores[r, :, : lens[r]], grouped.sum(1))
        torch.testing.assert_close(last[r, :, : lens[r]], grouped.mean(1))
        torch.testing.assert_close(first[r], logits[:, 0])
    assert scores[0, :, lens[0] :].abs().sum() == 0  # past seq_len: untouched


def test_prefill_reference_matches_dense_attention():
    lens, q_lens, hq, hkv, window = [9, 40], [9, 12], 4, 2, 5
    _, k, v, table, seq_lens, logical = make_cache(lens, hkv, 16, torch.float32)
    starts = torch.tensor([0, 9, 21], dtype=torch.int32, device=DEVICE)
    q = torch.randn(21, hq, HEAD_DIM, device=DEVICE)
    gain = torch.rand(hkv, 21, device=DEVICE) + 1
    out, sums, _ = reference.prefill_attention_reference(
        q, k, v, table, seq_lens, starts, 0.2, window, score_logit_scale=gain
    )
    for r, (keys, values) in enumerate(logical):
        n, ql = lens[r], q_lens[r]
        qr = q[int(starts[r]) : int(starts[r + 1])]
        kk = keys.repeat_interleave(hq // hkv, dim=1).to(DEVICE)
        vv = values.repeat_interleave(hq // hkv, dim=1).to(DEVICE)
        logits = torch.einsum("qhd,nhd->hqn", qr, kk) * 0.2
        causal = torch.arange(n, device=DEVICE)[None, :] <= (n - ql + torch.arange(ql, device=DEVICE))[:, None]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        torch.testing.assert_close(
            out[int(starts[r]) : int(starts[r + 1])], torch.einsum("hqn,nhd->qhd", probs, vv), rtol=1e-5, atol=1e-5
        )
        row_gain = gain[:, int(starts[r]) : int(starts[r + 1])].repeat_interleave(hq // hkv, dim=0)[:, :, None]
        scored = torch.softmax((logits * row_gain).masked_fill(~causal, float("-inf")), dim=-1)[:, ql - window :]
        torch.testing.assert_close(sums[r, :, :n], scored.reshape(hkv, -1, n).sum(1))


def test_compact_reference_matches_logical_gather():
    lens, hkv = [45, 20], 2
    kv, k, v, table, _, logical = make_cache(lens, hkv, 16, torch.float32)
    keep = torch.stack(
        [
            torch.tensor([[0, 3, 4, 5, 17, 30, 44], [2, 3, 4, 5, 6, 7, 8]]),
            torch.tensor([[1, 2, 3, 5, 8, 13, 19], [0, 1, 2, 3, 4, 5, 6]]),
        ]
    )
    stats = torch.arange(2 * hkv * 48, dtype=torch.float32, device=DEVICE).reshape(2, hkv, 48)
    expected_stats = stats.clone()
    reference.compact_reference(k, v, table, keep, stats=[stats])
    for r, (keys, values) in enumerate(logical):
        got_k, got_v = reference.gather_entries(k, v, table[r], 7)
        idx = keep[r].T  # [B, H]
        want_k = keys.gather(0, idx[:, :, None].expand(-1, -1, HEAD_DIM))
        want_v = values.gather(0, idx[:, :, None].expand(-1, -1, HEAD_DIM))
        torch.testing.assert_close(got_k.transpose(0, 1).cpu(), want_k)
        torch.testing.assert_close(got_v.transpose(0, 1).cpu(), want_v)
        torch.testing.assert_close(stats[r, :, :7], expected_stats[r].gather(1, keep[r].to(DEVICE)))
        torch.testing.assert_close(stats[r, :, 7:], expected_stats[r, :, 7:])


# ---- kernels against the references ----


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_kernel(dtype, block_size, heads, num_splits, head_dim):
    hq, hkv = heads
    _, k, v, table, seq_lens, _ = make_cache(SEQ_LENS, hkv, block_size, dtype, seed=block_size + hq, head_dim=head_dim)
    q = torch.randn(len(SEQ_LENS), hq, head_dim, device=DEVICE).to(dtype)
    block_n = 16 if num_splits is not None else None
    slots = max(SEQ_LENS) + 3
    scores = torch.rand(len(SEQ_LENS), hkv, slots, device=DEVICE)  # accumulation: starts non-zero
    last = torch.full_like(scores, -1.0)
    first = torch.zeros(len(SEQ_LENS), hq, device=DEVICE)
    bufs = [scores.clone(), last.clone(), first.clone()]
    scale = head_dim**-0.5
    out, lse = decode_attention.decode_attention_with_scores(
        q,
        k,
        v,
        table,
        seq_lens,
        scale,
        scores=scores,
        last_probs=last,
        first_logit=first,
        num_splits=num_splits,
        block_n=block_n,
    )
    ref_out, ref_lse = reference.decode_attention_reference(
        q, k, v, table, seq_lens, scale, scores=bufs[0], last_probs=bufs[1], first_logit=bufs[2]
    )
    torch.testing.assert_close(out.float(), ref_out.float(), **out_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, **PROB_TOL)
    torch.testing.assert_close(scores, bufs[0], **PROB_TOL)
    torch.testing.assert_close(last, bufs[1], **PROB_TOL)
    torch.testing.assert_close(first, bufs[2], **PROB_TOL)
    # Exact probabilities (final LSE whatever the split): a query's sum to 1, so one step adds the group size.
    fresh = torch.zeros(len(SEQ_LENS), hkv, slots, device=DEVICE)
    decode_attention.decode_attention_with_scores(
        q, k, v, table, seq_lens, scale, scores=fresh, num_splits=num_splits, block_n=block_n
    )
    group_sums = fresh.sum(-1)
    torch.testing.assert_close(group_sums, torch.full_like(group_sums, hq // hkv), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        last.clamp(min=0).sum(-1), torch.ones(len(SEQ_LENS), hkv, device=DEVICE), rtol=1e-5, atol=1e-5
    )
    for r, n in enumerate(SEQ_LENS):  # slots past the sequence are not written
        assert torch.all(last[r, :, n:] == -1.0)
        assert torch.all(fresh[r, :, n:] == 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_kernel_without_scores_same_output(dtype):
    _, k, v, table, seq_lens, _ = make_cache(SEQ_LENS, 2, 16, dtype)
    q = torch.randn(len(SEQ_LENS), 4, HEAD_DIM, device=DEVICE).to(dtype)
    plain, plain_lse = decode_attention.decode_attention_with_scores(
        q, k, v, table, seq_lens, 0.3, num_splits=2, block_n=16
    )
    scores = torch.zeros(len(SEQ_LENS), 2, max(SEQ_LENS), device=DEVICE)
    scored, scored_lse = decode_attention.decode_attention_with_scores(
        q, k, v, table, seq_lens, 0.3, scores=scores, num_splits=2, block_n=16
    )
    assert torch.equal(plain, scored) and torch.equal(plain_lse, scored_lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("variant", ["window", "gain-accumulate", "all-queries"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prefill_kernel(dtype, block_size, heads, variant, head_dim):
    hq, hkv = heads
    tiles = dict(block_m=16, block_n=16) if not CUDA or variant != "window" else {}  # GPU: default tiles too
    q_lens = [1, 17, 20] + ([300, 77] if CUDA else [])  # 1: decode-like; 17: whole prompt; 20: chunk after 25
    lens = SEQ_LENS
    _, k, v, table, seq_lens, _ = make_cache(lens, hkv, block_size, dtype, seed=7 * block_size + hq, head_dim=head_dim)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    total = int(starts[-1])
    q = torch.randn(total, hq, head_dim, device=DEVICE).to(dtype)
    window = {"window": 8, "gain-accumulate": 8, "all-queries": 10_000}[variant]
    gain = torch.rand(hkv, total, device=DEVICE) + 1 if variant == "gain-accumulate" else None
    accumulate = variant == "gain-accumulate"
    sums = torch.rand(len(lens), hkv, max(lens) + 5, device=DEVICE)
    ref_sums = sums.clone()
    scale = head_dim**-0.5
    out, sums, lse = prefill_window.prefill_attention_with_window_sums(
        q,
        k,
        v,
        table,
        seq_lens,
        starts,
        scale,
        window,
        window_sums=sums,
        accumulate=accumulate,
        score_logit_scale=gain,
        **tiles,
    )
    ref_out, ref_sums, ref_lse = reference.prefill_attention_reference(
        q,
        k,
        v,
        table,
        seq_lens,
        starts,
        scale,
        window,
        window_sums=ref_sums,
        accumulate=accumulate,
        score_logit_scale=gain,
    )
    torch.testing.assert_close(out.float(), ref_out.float(), **out_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, **PROB_TOL)
    torch.testing.assert_close(sums, ref_sums, **PROB_TOL)
    if not accumulate:  # each window query's probabilities sum to 1, per query head
        for r, (n, ql) in enumerate(zip(lens, q_lens, strict=True)):
            want = torch.full((hkv,), float(min(window, ql) * (hq // hkv)), device=DEVICE)
            torch.testing.assert_close(sums[r, :, :n].sum(-1), want, rtol=1e-5, atol=1e-4)


def _keep_sets(lens, num_kv_heads, budget, gen):
    """Per request and head, ascending keep sets that overlap their destinations: identity, shifted runs, random."""
    rows = []
    for n in lens:
        b = min(budget, n)
        heads = []
        for h in range(num_kv_heads):
            kind = h % 3
            if kind == 0:  # shifted run keep[j] = j + shift (shift < b): most sources are other entries' destinations
                heads.append(torch.arange(b) + min(n - b, 5))
            elif kind == 1:  # random subset including sinks
                heads.append(torch.sort(torch.randperm(n, generator=gen)[:b]).values)
            else:  # identity prefix then a jump (copies partly in place)
                heads.append(torch.cat([torch.arange(b // 2), torch.arange(n - (b - b // 2), n)]))
        rows.append(torch.stack([torch.nn.functional.pad(t, (0, budget - b)) for t in heads]))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_compaction_kernel(dtype, block_size, layout):
    lens, hkv, budget = [45, 17, 40], 3, 20
    kv, k, v, table, _, _ = make_cache(lens, hkv, block_size, dtype, layout=layout, seed=block_size)
    gen = torch.Generator().manual_seed(1)
    keep = _keep_sets(lens, hkv, budget, gen).to(DEVICE)
    counts = torch.tensor([min(budget, n) for n in lens], dtype=torch.int32, device=DEVICE)
    counts[2] = 11  # a request keeping fewer than the batch width
    stats = [torch.randn(len(lens), hkv, 48, device=DEVICE), torch.randn(len(lens), hkv, 48, device=DEVICE)]
    ref_kv = kv.clone()
    ref_k, ref_v = split_kv_cache(ref_kv, HEAD_DIM)
    ref_stats = [s.clone() for s in stats]
    compaction.compact(k, v, table, keep, keep_counts=counts, stats=stats, block_j=8)
    reference.compact_reference(ref_k, ref_v, table, keep, keep_counts=counts, stats=ref_stats)
    assert torch.equal(kv, ref_kv)  # every block: moved entries, tails and blocks of nobody alike
    for got, want in zip(stats, ref_stats, strict=True):
        assert torch.equal(got, want)


def test_compaction_kernel_without_counts_against_logical_entries():
    lens, hkv = [64], 2
    _, k, v, table, _, logical = make_cache(lens, hkv, 16, torch.float32)
    # head 0: the odd entries; head 1: keep[j] = j + 1, so slot j is overwritten right after entry j - 1 read it,
    # within a tile and across tiles (tiles processed out of order, or stores before the tile's loads, would fail)
    keep = torch.stack([torch.arange(1, 64, 2), torch.arange(1, 33)])[None].to(DEVICE)
    compaction.compact(k, v, table, keep, block_j=8)
    got_k, got_v = reference.gather_entries(k, v, table[0], 32)
    keys, values = logical[0]
    for h in range(hkv):
        torch.testing.assert_close(got_k[h].cpu(), keys[keep[0, h].cpu(), h])
        torch.testing.assert_close(got_v[h].cpu(), values[keep[0, h].cpu(), h])


# ---- dispatch ----


def test_dispatch_chooses_by_device(monkeypatch):
    monkeypatch.delenv(kernel_dispatch.BACKEND_ENV, raising=False)
    assert kernel_dispatch.use_triton(torch.device("cuda")) and not kernel_dispatch.use_triton(torch.device("cpu"))
    assert kernel_dispatch.use_triton(torch.device("cpu"), "triton")
    assert not kernel_dispatch.use_triton(torch.device("cuda"), "torch")
    monkeypatch.setenv(kernel_dispatch.BACKEND_ENV, "triton")
    assert kernel_dispatch.use_triton(torch.device("cpu"))
    monkeypatch.setenv(kernel_dispatch.BACKEND_ENV, "gpu")
    with pytest.raises(ValueError):
        kernel_dispatch.use_triton(torch.device("cpu"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dispatch_runs_both_paths(backend):
    lens, hq, hkv = [17, 33], 4, 2
    kv, k, v, table, seq_lens, _ = make_cache(lens, hkv, 16, torch.float32)
    q = torch.randn(2, hq, HEAD_DIM, device=DEVICE)
    scores = torch.zeros(2, hkv, 40, device=DEVICE)
    out, _ = kernel_dispatch.decode_attention_with_scores(q, k, v, table, seq_lens, 0.2, scores=scores, backend=backend)
    want, _ = reference.decode_attention_reference(q, k, v, table, seq_lens, 0.2)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    starts = torch.tensor([0, 17, 20], dtype=torch.int32, device=DEVICE)
    pq = torch.randn(20, hq, HEAD_DIM, device=DEVICE)
    pout, sums, _ = kernel_dispatch.prefill_attention_with_window_sums(
        pq, k, v, table, torch.tensor([17, 20], dtype=torch.int32, device=DEVICE), starts, 0.2, 4, backend=backend
    )
    rout, rsums, _ = reference.prefill_attention_reference(
        pq, k, v, table, torch.tensor([17, 20], dtype=torch.int32, device=DEVICE), starts, 0.2, 4
    )
    torch.testing.assert_close(pout, rout, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sums, rsums, **PROB_TOL)
    keep = torch.tensor([[[0, 5, 9, 16], [1, 2, 3, 4]], [[3, 4, 5, 30], [0, 1, 2, 32]]], device=DEVICE)
    ref_kv = kv.clone()
    kernel_dispatch.compact(k, v, table, keep, backend=backend)
    reference.compact_reference(*split_kv_cache(ref_kv, HEAD_DIM), table, keep)
    assert torch.equal(kv, ref_kv)


def test_split_kv_cache_is_vllm_flash_attention_split():
    kv = new_kv_cache(3, 2, 16, HEAD_DIM, torch.float16, DEVICE)
    k, v = kernel_dispatch.split_kv_cache(kv, HEAD_DIM)
    assert k.shape == (3, 16, 2, HEAD_DIM) and v.shape == k.shape
    k.fill_(1.0)
    v.fill_(2.0)
    assert torch.all(kv[..., :HEAD_DIM] == 1.0) and torch.all(kv[..., HEAD_DIM:] == 2.0)  # views into the cache


def test_interpreter_env_not_leaked():
    # The vLLM processes other tests start inherit os.environ: the interpreter setting stays local to this module.
    assert _INTERPRET_AFTER_IMPORT == _INTERPRET_BEFORE


# --------------------------------------------------------------------------------------------------------------------
# The attention backend's scoring path (kvserve/worker/eviction.py) through the dispatch: the same request served
# over vLLM's CPU cache with the PyTorch operations and over the GPU (FlashAttention) cache with the Triton kernels
# keeps the same entries, with the same statistics and the same compacted cache; and both equal the policy computing
# its statistics from the keys itself (no measurement from the attention pass).
# --------------------------------------------------------------------------------------------------------------------

# a budget above every registered policy's default protected window (32), below the 80-token prompt chunk
PATH_HEADS, PATH_GROUP, PATH_BLOCK, PATH_BUDGET, PATH_PROMPT, PATH_LAYER = 2, 2, 32, 48, 80, 3
PATH_POLICIES = representative_policies(ragged=False)  # every registered policy that ranks entries against a budget
# the allocations and spans (kvserve/worker/allocated.py) on the same path; the served layer is the worker's last, so
# `global` ranks it at once
PATH_ALLOCATIONS = {"snapkv/heads/span8": ("snapkv", "heads", 8), "h2o/global": ("h2o", "global", 1)}
PATH_ALLOCATIONS["tova/pyramid/span4"] = ("tova", "pyramid", 4)


def _serve_one_layer(
    policy: str,
    layout: str,
    measure: bool,
    monkeypatch,
    dtype: torch.dtype = torch.float32,
    allocation: str = "uniform",
    span: int = 1,
) -> dict:
    """An 80-token prompt chunk compacted to the budget, then three decode steps, the last one compacting again.
    `layout`: "cpu" (vLLM's CPU "vec" pages), "flash" (the GPU layout) or "amx" (vLLM's AMX pages), each written
    by vLLM's own op where vLLM has one and read through the layout the backend picks (`kvserve/worker/layouts/`).
    The request's lists live in head pages of 3 blocks."""
    from kvserve.config import parse_kv_config
    from kvserve.messages import Compaction
    from kvserve.policies.base import PassStatistics
    from kvserve.worker import eviction
    from kvserve.worker.layouts import AmxPages, FlashPages, VecPages
    from kvserve.worker.pages import HeadPages, PageLayout
    from kvserve.worker.request import WorkerRequest
    from kvserve.worker.step import RowPlan, StepContext

    if not measure:
        monkeypatch.setattr(eviction, "measure_pass", lambda *args, **kwargs: PassStatistics())
        monkeypatch.setattr(eviction, "measure_decode_rows", lambda *args, **kwargs: {})
    generator = torch.Generator().manual_seed(7)
    device = DEVICE if layout == "flash" else torch.device("cpu")  # vLLM's CPU layouts live in host memory
    page_layout = PageLayout(num_layers=PATH_LAYER + 1, num_blocks=8, num_heads=PATH_HEADS, block_size=PATH_BLOCK)
    num_pages, hq = page_layout.num_layers * page_layout.num_blocks * PATH_HEADS, PATH_HEADS * PATH_GROUP
    raw = torch.zeros(num_pages, 1, PATH_BLOCK, 2 * HEAD_DIM, dtype=dtype)
    if layout == "flash":
        paged = FlashPages(new_kv_cache(num_pages, 1, PATH_BLOCK, HEAD_DIM, torch.float32, device).zero_())
    else:
        paged = (AmxPages if layout == "amx" else VecPages)(raw)
    request = {"kv_policy": policy, "kv_budget": PATH_BUDGET, "kv_allocation": allocation, "kv_span": span}
    if POLICIES[policy]().protected_tokens() >= PATH_BUDGET:  # expected_attention keeps its 64-query window
        request["kv_window"] = 16
    config = parse_kv_config(request, defaults={})
    rotary = {PATH_LAYER: Rotary.default(HEAD_DIM, 10000.0, 4096)}  # as the runner reads it from a RoPE model
    state = WorkerRequest(config=config, policy=config.make_policy(), pages=HeadPages(page_layout), rotary=rotary)
    state.pages.add_blocks([5, 2, 7])
    logical = 0

    def table() -> torch.Tensor:
        return torch.from_numpy(state.pages.table[PATH_LAYER]).to(device=device, dtype=torch.int32)

    def lengths() -> torch.Tensor:
        return torch.from_numpy(state.pages.lens[PATH_LAYER])

    for tokens, compact in ((PATH_PROMPT, True), (1, False), (1, False), (1, True)):
        keys, values, queries = (
            torch.randn(tokens, heads, HEAD_DIM, generator=generator).to(dtype)
            for heads in (PATH_HEADS, PATH_HEADS, hq)
        )
        slots = torch.from_numpy(state.pages.append(tokens)[PATH_LAYER]).T  # [q, H]
        logical += tokens
        if layout != "amx":  # the views, as vLLM's "vec" writer or kvserve's attention writes them
            paged.write_slots(slots.reshape(-1).to(device), keys.reshape(-1, HEAD_DIM), values.reshape(-1, HEAD_DIM))
        else:  # vLLM's own AMX writer, in its tile format (kvserve's codec where it cannot run: cache_writers.py)
            from cache_writers import write

            write(raw, "amx", keys.reshape(-1, HEAD_DIM), values.reshape(-1, HEAD_DIM), slots.reshape(-1))
        compaction = Compaction(PATH_BUDGET, logical, int(lengths().max())) if compact else None
        plan = RowPlan(
            req_id="r", state=state, row=0, query_start=0, query_end=tokens, logical_len=logical, compaction=compaction
        )
        eviction.after_attention(
            StepContext(pages=None, rows=[plan]),
            PATH_LAYER,
            queries.to(device),
            paged,
            {"r": table()},
            HEAD_DIM**-0.5,
            torch.empty_like(queries, device=device),
        )
        assert plan.failure is None, plan.failure
        if compact:
            state.since = logical
    layer = state.layer(PATH_LAYER)
    keys, values = paged.read_lists(table(), lengths())
    return {
        "positions": layer.kept_positions.cpu(),
        "keys": keys.cpu(),
        "values": values.cpu(),
        "stats": {name: stat.cpu() for name, stat in layer.stats.items()},
    }


@pytest.mark.parametrize(
    "setting",
    [(policy, "uniform", 1) for policy in PATH_POLICIES] + list(PATH_ALLOCATIONS.values()),
    ids=PATH_POLICIES + list(PATH_ALLOCATIONS),
)
def test_backend_scoring_path_same_on_both_layouts_and_backends(setting, monkeypatch):
    policy, allocation, span = setting
    serve = functools.partial(_serve_one_layer, policy, allocation=allocation, span=span)
    monkeypatch.setenv(kernel_dispatch.BACKEND_ENV, "torch")
    with monkeypatch.context() as patched:
        from_keys = serve("cpu", measure=False, monkeypatch=patched)
    cpu_torch = serve("cpu", measure=True, monkeypatch=monkeypatch)
    monkeypatch.setenv(kernel_dispatch.BACKEND_ENV, "triton")
    gpu_triton = serve("flash", measure=True, monkeypatch=monkeypatch)
    for got in (cpu_torch, gpu_triton):
        assert torch.equal(got["positions"], from_keys["positions"])
        torch.testing.assert_close(got["keys"], from_keys["keys"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["values"], from_keys["values"], rtol=1e-5, atol=1e-6)
        assert got["stats"].keys() == from_keys["stats"].keys()
        for name, stat in from_keys["stats"].items():
            torch.testing.assert_close(got["stats"][name], stat, **PROB_TOL)
    kept = (from_keys["positions"] >= 0).sum(dim=1)
    if allocation == "uniform":
        assert kept.tolist() == [PATH_BUDGET] * PATH_HEADS
    elif allocation == "pyramid":  # every head the layer's budget
        assert len(set(kept.tolist())) == 1 and int(kept[0]) < PATH_BUDGET
    else:  # the layer's H x B, shared by the scores
        assert int(kept.sum()) == PATH_HEADS * PATH_BUDGET


@pytest.mark.parametrize(
    "setting",
    [(policy, "uniform", 1) for policy in PATH_POLICIES] + list(PATH_ALLOCATIONS.values()),
    ids=PATH_POLICIES + list(PATH_ALLOCATIONS),
)
def test_amx_pages_serve_as_the_vec_layout(setting, monkeypatch):
    """bf16 on a CPU with AMX: vLLM stores blocks in its AMX format, written here by vLLM's own op (which runs on any
    CPU). Same entries kept and the same compacted entries as the "vec" layout, bit for bit, and the same statistics
    up to summation order, for every policy and allocation (`global` included: it ranks the page view's layers at
    once)."""
    pytest.importorskip("vllm", reason="vLLM's AMX writer is the reference for the format")
    policy, allocation, span = setting
    monkeypatch.setenv(kernel_dispatch.BACKEND_ENV, "torch")
    serve = functools.partial(_serve_one_layer, policy, measure=True, monkeypatch=monkeypatch, dtype=torch.bfloat16)
    vec = serve("cpu", allocation=allocation, span=span)
    amx = serve("amx", allocation=allocation, span=span)
    assert torch.equal(amx["positions"], vec["positions"])
    assert torch.equal(amx["keys"], vec["keys"]) and torch.equal(amx["values"], vec["values"])
    assert amx["stats"].keys() == vec["stats"].keys()
    for name, stat in vec["stats"].items():  # a decode step multiplies the AMX tiles as stored: another sum order
        torch.testing.assert_close(amx["stats"][name], stat, **PROB_TOL)
