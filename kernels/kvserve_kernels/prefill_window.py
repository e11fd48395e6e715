"""Causal varlen (chunked-)prefill attention plus the observation window's column sums (reference: `reference.py`).

Each request r of the batch has q_len = query_start_loc[r+1] - query_start_loc[r] new queries, the last q_len of its
seq_lens[r] cache entries (written before attention, as vLLM does); query i sees entries 0 .. seq_len - q_len + i.
The window is the last min(window, q_len) queries of the chunk. Two launches, no [q, n] matrix in memory:

1. attention kernel, grid (request, query head, query tile): flash attention with online softmax through the block
   table -> output and each query's LSE; with a logit scale (AhaKV's step gain: scores use softmax(gain * logits))
   it also keeps a second online max / sum over the scaled logits, the LSE of the score distribution.
2. window kernel, grid (request, KV head, slot tile): loads its key tile once, and for every window query of every
   query head of the group recomputes the logits (window x tile, cheap next to the q x n of step 1), normalises with
   the final LSE from step 1 (exact probabilities) and sums them over queries and heads. Each program owns its
   slots: no atomics, deterministic. Written (=) or added (+=, `accumulate`, H2O over prefill with window >= q_len).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_buffer, dot_settings, load_kv_tile, pow2
from .layout import check_cache
from .reference import expand_logit_scale


@triton.jit
def _prefill_attention_kernel(
    Q,
    K,
    V,
    BLOCK_TABLE,
    SEQ_LENS,
    QSL,
    GAIN,
    OUT,
    LSE,
    LSE_SCORE,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btr,
    stride_ot,
    stride_oh,
    stride_gh,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_GAIN: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_start = tl.load(QSL + req)
    q_len = tl.load(QSL + req + 1) - q_start
    if m0 >= q_len:
        return
    seq_len = tl.load(SEQ_LENS + req)
    context = seq_len - q_len
    kv_head = head // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    if HAS_GAIN:
        gain = tl.load(GAIN + head * stride_gh + rows, mask=m_mask, other=1.0)
        m_s = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_s = tl.zeros([BLOCK_M], tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BLOCK_TABLE + req.to(tl.int64) * stride_btr
    hi = tl.minimum(context + m0 + BLOCK_M, seq_len)  # the tile's last query sees up to context + m0 + BLOCK_M - 1
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seq_len
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
        raw = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = n_mask[None, :] & (offs_n[None, :] <= context + offs_m[:, None])
        s = tl.where(visible, raw, float("-inf"))  # slot 0 is visible to every row: m_new is finite from tile 0
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
        if HAS_GAIN:
            s2 = tl.where(visible, raw * gain[:, None], float("-inf"))
            m2 = tl.maximum(m_s, tl.max(s2, axis=1))
            l_s = l_s * tl.exp(m_s - m2) + tl.sum(tl.exp(s2 - m2[:, None]), axis=1)
            m_s = m2

    out = acc / l_i[:, None]
    tl.store(
        OUT + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
    tl.store(LSE + rows * NUM_Q_HEADS + head, m_i + tl.log(l_i), mask=m_mask)
    if HAS_GAIN:
        tl.store(LSE_SCORE + rows * NUM_Q_HEADS + head, m_s + tl.log(l_s), mask=m_mask)


@triton.jit
def _window_sums_kernel(
    Q,
    K,
    BLOCK_TABLE,
    SEQ_LENS,
    QSL,
    GAIN,
    LSE_SCORE,
    SUMS,
    scale,
    window,
    num_slots,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_btr,
    stride_gh,
    stride_sr,
    stride_sh,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_GAIN: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N
    seq_len = tl.load(SEQ_LENS + req)
    limit = tl.minimum(seq_len, num_slots)
    if n0 >= limit:
        return
    q_start = tl.load(QSL + req)
    q_len = tl.load(QSL + req + 1) - q_start
    context = seq_len - q_len
    first_row = q_len - tl.minimum(window, q_len)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < limit
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    block = tl.load(BLOCK_TABLE + req.to(tl.int64) * stride_btr + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    k = tl.load(
        K + block[:, None] * stride_kb + (offs_n % PAGE)[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_F32:
        k = k.to(tl.float32)
    colsum = tl.zeros([BLOCK_N], tl.float32)
    for g in range(0, GROUP):
        head = kv_head * GROUP + g
        for m0 in range(first_row, q_len, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < q_len
            rows = (q_start + offs_m).to(tl.int64)
            q = tl.load(
                Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
            if DOT_F32:
                q = q.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if HAS_GAIN:
                s = s * tl.load(GAIN + head * stride_gh + rows, mask=m_mask, other=1.0)[:, None]
            lse = tl.load(LSE_SCORE + rows * NUM_Q_HEADS + head, mask=m_mask, other=0.0)
            visible = m_mask[:, None] & n_mask[None, :] & (offs_n[None, :] <= context + offs_m[:, None])
            colsum += tl.sum(tl.where(visible, tl.exp(s - lse[:, None]), 0.0), axis=0)
    ptr = SUMS + req.to(tl.int64) * stride_sr + kv_head * stride_sh + offs_n
    if ACCUMULATE:
        colsum += tl.load(ptr, mask=n_mask, other=0.0)
    tl.store(ptr, colsum, mask=n_mask)


def prefill_attention_with_window_sums(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int,
    *,
    window_sums: torch.Tensor | None = None,
    accumulate: bool = False,
    score_logit_scale: torch.Tensor | None = None,
    max_slots: int | None = None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal varlen prefill attention plus the window queries' attention column sums.

    Args:
        q: [T, Hq, D], the requests' new queries back to back (vLLM's `query_start_loc` order).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] views (`layout.split_kv_cache`) already holding
            every request's seq_lens[r] entries, this chunk's included.
        block_table: [R, max_blocks] int32; seq_lens: [R] int32; query_start_loc: [R + 1] int32.
        scale: softmax scale on q.k.
        window: W; the last min(W, q_len) queries of each request vote (W >= q_len: all of them).
        window_sums: [R, Hkv, S] float32 or None (then zeros with S = max_slots or max(seq_lens)).
            window_sums[r, h, i] (i < min(seq_lens[r], S)) = sum over the window queries and the query heads of KV
            head h of the probability of entry i; written, or added with `accumulate`. Other slots untouched.
        score_logit_scale: None or a positive multiplier of the logits used for the SUMS only (not the output):
            [T] (per query), [Hkv, T] or [Hq, T]; the sums then use softmax(scale_row * logits).
        max_seq_len, max_query_len: host-side maxima if known (else read from the tensors, a device sync).
        block_m, block_n: query / slot tile sizes (powers of two >= 16).
        out: optional [T, Hq, D] output in q's dtype.

    Returns:
        (out [T, Hq, D], window_sums [R, Hkv, S] float32, lse [T, Hq] float32 of the unscaled logits).
    """
    block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [T, Hq, {head_dim}] with Hq a multiple of {num_kv_heads}, got {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise ValueError("q's last dimension must be contiguous")
    if window < 0:
        raise ValueError("window must be >= 0")
    total, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    num_reqs = query_start_loc.shape[0] - 1
    device = q.device
    if max_seq_len is None:
        max_seq_len = int(seq_lens[:num_reqs].max()) if num_reqs else 0
    if window_sums is None:
        window_sums = torch.zeros(
            num_reqs,
            num_kv_heads,
            max_slots if max_slots is not None else max_seq_len,
            dtype=torch.float32,
            device=device,
        )
    check_buffer("window_sums", window_sums, (num_reqs, num_kv_heads, 1), device, min_last=True)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(total, num_q_heads, dtype=torch.float32, device=device)
    if num_reqs == 0 or total == 0:
        return out, window_sums, lse
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    gain = None
    if score_logit_scale is not None:
        gain = expand_logit_scale(score_logit_scale.to(device), num_q_heads, num_kv_heads, total)
    lse_score = torch.empty_like(lse) if gain is not None else lse
    gain_arg = gain if gain is not None else lse
    block_m = block_m or (64 if head_dim <= 128 else 32)
    block_n = block_n or (64 if head_dim <= 128 else 32)
    block_d = pow2(head_dim, 16)
    dot_f32, precision = dot_settings(key_cache.dtype, _prefill_attention_kernel)
    common = dict(
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE=block_size,
        HAS_GAIN=gain is not None,
        DOT_F32=dot_f32,
        PRECISION=precision,
    )
    _prefill_attention_kernel[(num_reqs, num_q_heads, triton.cdiv(max_query_len, block_m))](
        q,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        gain_arg,
        out,
        lse,
        lse_score,
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
        out.stride(0),
        out.stride(1),
        gain_arg.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **common,
    )
    num_slots = window_sums.shape[-1]
    slot_tiles = triton.cdiv(min(max_seq_len, num_slots), block_n)
    if slot_tiles > 0:  # window == 0 still runs: it writes zeros (or adds nothing), like the reference
        _window_sums_kernel[(num_reqs, num_kv_heads, slot_tiles)](
            q,
            key_cache,
            block_table,
            seq_lens,
            query_start_loc,
            gain_arg,
            lse_score,
            window_sums,
            scale,
            window,
            num_slots,
            q.stride(0),
            q.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            block_table.stride(0),
            gain_arg.stride(0),
            window_sums.stride(0),
            window_sums.stride(1),
            BLOCK_M=min(block_m, pow2(window, 16)),
            BLOCK_N=block_n,
            ACCUMULATE=accumulate,
            **common,
        )
    return out, window_sums, lse
