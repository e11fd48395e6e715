"""Paged decode attention that produces the eviction scores in the same pass (reference: `reference.py`).

One query per request (a decode batch), GQA, over vLLM's paged cache (`layout.py`). Three launches:

1. split kernel, grid (request, KV head, split): flash-decoding. Each program takes one KV head with all of its
   group's query heads (one K/V tile load serves the whole group, `tl.dot` on a [group, BLOCK_N] tile) over a
   contiguous range of the request's slots, keeps the online-softmax max / sum / unnormalised output, and, when
   scores are asked for, stores the raw logits (fp32) of its slots. Split 0 also writes the logit to slot 0 (MAT).
2. reduce kernel, grid (request, query head): merges the splits with the final log-sum-exp (LSE) -> output, LSE.
3. score kernel, grid (request, KV head, slot tile): p = exp(logit - LSE) with the FINAL LSE, so the probabilities
   are exact whatever the split; sums p over the group's query heads into `scores` (+=, H2O) and writes the mean
   over the group into `last_probs` (TOVA). Each program owns its slots: no atomics, deterministic.

Scoring costs one fp32 write and one read per (query head, slot) (4 * group bytes per KV head and slot, against
2 * head_size * itemsize for K and V) plus a read-modify-write of the score row; the keys are never re-read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_buffer, dot_settings, load_kv_tile, pow2
from .layout import check_cache


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    BLOCK_TABLE,
    SEQ_LENS,
    MID_O,
    MID_M,
    MID_L,
    LOGITS,
    FIRST,
    scale,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btr,
    stride_lr,
    stride_lh,
    stride_fr,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    STORE_FIRST: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + req)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + req * stride_qr + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = BLOCK_TABLE + req.to(tl.int64) * stride_btr
    logit_rows = LOGITS + req.to(tl.int64) * stride_lr + heads[:, None] * stride_lh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k, v = load_kv_tile(
            K,
            V,
            bt_row,
            offs_n,
            n_mask,
            offs_d,
            d_mask,
            kv_head,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            PAGE,
            DOT_F32,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        if STORE_LOGITS:
            tl.store(logit_rows + offs_n[None, :], s, mask=g_mask[:, None] & n_mask[None, :])
        if STORE_FIRST:
            if n0 == 0:
                first = tl.sum(tl.where(offs_n[None, :] == 0, s, 0.0), axis=1)
                tl.store(FIRST + req * stride_fr + heads, first, mask=g_mask)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    mid = (req * NUM_Q_HEADS + heads) * NUM_SPLITS + split  # an empty split stores m = -inf, l = 0, acc = 0
    tl.store(MID_M + mid, m_i, mask=g_mask)
    tl.store(MID_L + mid, l_i, mask=g_mask)
    tl.store(
        MID_O + mid[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :]
    )


@triton.jit
def _decode_reduce_kernel(
    MID_O,
    MID_M,
    MID_L,
    OUT,
    LSE,
    stride_or,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    base = (req * NUM_Q_HEADS + head) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m = tl.load(MID_M + base + offs_s, mask=s_mask, other=float("-inf"))
    l_part = tl.load(MID_L + base + offs_s, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    total = tl.sum(l_part * w, axis=0)
    acc = tl.load(
        MID_O + (base + offs_s)[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(OUT + req * stride_or + head * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_mask)
    tl.store(LSE + req * NUM_Q_HEADS + head, m_max + tl.log(total))


@triton.jit
def _decode_scores_kernel(
    LOGITS,
    LSE,
    SEQ_LENS,
    SCORES,
    LAST,
    stride_lr,
    stride_lh,
    stride_sr,
    stride_sh,
    stride_pr,
    stride_ph,
    score_slots,
    last_slots,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SCORES: tl.constexpr,
    HAS_LAST: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + req)
    offs = tile * BLOCK_S + tl.arange(0, BLOCK_S)
    n_mask = offs < seq_len
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    lse = tl.load(LSE + req * NUM_Q_HEADS + heads, mask=g_mask, other=0.0)
    s = tl.load(
        LOGITS + req.to(tl.int64) * stride_lr + heads[:, None] * stride_lh + offs[None, :],
        mask=g_mask[:, None] & n_mask[None, :],
        other=float("-inf"),
    )
    total = tl.sum(tl.exp(s - lse[:, None]), axis=0)
    if HAS_SCORES:
        mask = n_mask & (offs < score_slots)
        ptr = SCORES + req.to(tl.int64) * stride_sr + kv_head * stride_sh + offs
        tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + total, mask=mask)
    if HAS_LAST:
        mask = n_mask & (offs < last_slots)
        tl.store(LAST + req.to(tl.int64) * stride_pr + kv_head * stride_ph + offs, total / GROUP, mask=mask)


def default_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough (request, KV head, split) programs to fill the GPU twice, at least 256 slots per split, at most 64."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    wanted = triton.cdiv(2 * sms, max(num_reqs * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(max(max_seq_len, 1), 256), 64))


def decode_attention_with_scores(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    scores: torch.Tensor | None = None,
    last_probs: torch.Tensor | None = None,
    first_logit: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over the paged cache, with the eviction statistics from the same pass.

    Args:
        q: [R, Hq, D], one query per request (row r is request r of `block_table` / `seq_lens`).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] views (`layout.split_kv_cache`), any strides
            with a contiguous last dimension; every request's first seq_lens[r] entries (this step's token
            included) must already be in the cache.
        block_table: [R, max_blocks] int32. seq_lens: [R] int32, each >= 1.
        scale: softmax scale on q.k.
        scores: [R, Hkv, S] float32 or None. scores[r, h, i] += sum over the query heads of KV head h of the
            probability of entry i (H2O accumulation), for i < min(seq_lens[r], S).
        last_probs: [R, Hkv, S'] float32 or None. Written (=) with the MEAN over the group's query heads of the
            probabilities (TOVA), for i < min(seq_lens[r], S'); other slots untouched.
        first_logit: [R, Hq] float32 or None. Written with q.k_0 * scale, the logit to entry 0, per query head
            (MAT averages it over the group).
        max_seq_len: max(seq_lens) if known on the host (avoids a device sync); must not be smaller.
        num_splits: sequence splits (flash-decoding); default `default_num_splits`.
        block_n: slots per tile (power of two >= 16); default 64 (32 for head_size > 128).
        out: optional [R, Hq, D] output buffer in q's dtype.

    Returns:
        (out [R, Hq, D] in q's dtype, lse [R, Hq] float32: the log-sum-exp of each query's logits).
    """
    block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [R, Hq, {head_dim}] with Hq a multiple of {num_kv_heads}, got {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise ValueError("q's last dimension must be contiguous")
    num_reqs, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    device = q.device
    check_buffer("scores", scores, (num_reqs, num_kv_heads, 1), device, min_last=True)
    check_buffer("last_probs", last_probs, (num_reqs, num_kv_heads, 1), device, min_last=True)
    check_buffer("first_logit", first_logit, (num_reqs, num_q_heads), device)
    if block_table.shape[0] < num_reqs or seq_lens.shape[0] < num_reqs:
        raise ValueError("block_table and seq_lens need a row per request")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(num_reqs, num_q_heads, dtype=torch.float32, device=device)
    if num_reqs == 0:
        return out, lse
    if max_seq_len is None:
        max_seq_len = int(seq_lens[:num_reqs].max())
    if num_splits is None:
        num_splits = default_num_splits(num_reqs, num_kv_heads, max_seq_len, device)
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    need_logits = scores is not None or last_probs is not None
    mid_o = torch.empty(num_reqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    mid_m = torch.empty(num_reqs, num_q_heads, num_splits, dtype=torch.float32, device=device)
    mid_l = torch.empty_like(mid_m)
    logits = torch.empty(num_reqs, num_q_heads, max_seq_len if need_logits else 1, dtype=torch.float32, device=device)
    first = first_logit if first_logit is not None else lse  # placeholder pointer when unused
    dot_f32, precision = dot_settings(key_cache.dtype, _decode_split_kernel)
    block_g = pow2(group, 16)
    block_d = pow2(head_dim, 16)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        mid_o,
        mid_m,
        mid_l,
        logits,
        first,
        scale,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        logits.stride(0),
        logits.stride(1),
        first.stride(0),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        STORE_LOGITS=need_logits,
        STORE_FIRST=first_logit is not None,
        DOT_F32=dot_f32,
        PRECISION=precision,
    )
    _decode_reduce_kernel[(num_reqs, num_q_heads)](
        mid_o,
        mid_m,
        mid_l,
        out,
        lse,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        BLOCK_S=pow2(num_splits, 2),
    )
    if need_logits:
        score_buf = scores if scores is not None else lse
        last_buf = last_probs if last_probs is not None else lse
        # 1024 slots a program: at 128 this launch read well below the copy bandwidth (profiled on an H100:
        # `python -m kvserve_kernels.profile`; timings in docs/benchmarks.md, section "The kernels on a GPU")
        block_s = 1024
        _decode_scores_kernel[(num_reqs, num_kv_heads, triton.cdiv(max_seq_len, block_s))](
            logits,
            lse,
            seq_lens,
            score_buf,
            last_buf,
            logits.stride(0),
            logits.stride(1),
            score_buf.stride(0),
            score_buf.stride(1) if score_buf.dim() == 3 else 0,
            last_buf.stride(0),
            last_buf.stride(1) if last_buf.dim() == 3 else 0,
            score_buf.shape[-1],
            last_buf.shape[-1],
            NUM_Q_HEADS=num_q_heads,
            GROUP=group,
            BLOCK_G=pow2(group, 2),
            BLOCK_S=block_s,
            HAS_SCORES=scores is not None,
            HAS_LAST=last_probs is not None,
        )
    return out, lse
