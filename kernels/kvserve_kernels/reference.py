"""PyTorch references of the three kernels (and kvserve's CPU path): same arguments, same results, fp32 math.

Pure PyTorch, no Triton import. They gather each request's entries through the block table (layout in `layout.py`)
and loop over requests in Python, so they are meant for CPU serving, tests and benchmarks, not for speed on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import check_cache

QUERY_CHUNK = 256  # prefill queries per step: the reference never materialises a [q, n] matrix larger than this


def gather_entries(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_row: torch.Tensor, num_entries: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `num_entries` entries of one request (its block-table row): keys and values, each [H, n, D]."""
    block_size = key_cache.shape[1]
    slots = torch.arange(num_entries, device=key_cache.device)
    blocks = block_row.to(key_cache.device)[slots // block_size].long()
    offsets = slots % block_size
    return key_cache[blocks, offsets].transpose(0, 1), value_cache[blocks, offsets].transpose(0, 1)


def decode_attention_reference(
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
    need_output: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One decode query per request. See `decode_attention.decode_attention_with_scores` for the contract.

    Returns (out [R, Hq, D] in q's dtype, lse [R, Hq] float32); updates `scores` (+=, summed over the group's query
    heads), `last_probs` (=, mean over the group) for slots < min(seq_len, slots) and `first_logit` (=, q.k_0*scale).
    With `need_output=False` (kvserve's CPU path: vLLM's kernel already produced the output) only the statistics are
    computed and (None, None) is returned.
    """
    check_cache(key_cache, value_cache, contiguous_head=False)
    num_reqs, num_q_heads, dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q) if need_output else None
    lse = torch.empty(num_reqs, num_q_heads, dtype=torch.float32, device=q.device) if need_output else None
    probs_needed = need_output or scores is not None or last_probs is not None
    for r, n in enumerate(seq_lens.tolist()):
        keys, values = gather_entries(key_cache, value_cache, block_table[r], n if probs_needed else 1)
        query = q[r].float().reshape(num_kv_heads, group, dim)
        logits = torch.einsum("hgd,hnd->hgn", query, keys.float()) * scale
        if first_logit is not None:
            first_logit[r] = logits[:, :, 0].reshape(num_q_heads)
        if not probs_needed:
            continue
        row_lse = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - row_lse[..., None])
        if need_output:
            out[r] = torch.einsum("hgn,hnd->hgd", probs, values.float()).reshape(num_q_heads, dim).to(q.dtype)
            lse[r] = row_lse.reshape(num_q_heads)
        if scores is not None:
            m = min(n, scores.shape[-1])
            scores[r, :, :m] += probs.sum(dim=1)[:, :m]
        if last_probs is not None:
            m = min(n, last_probs.shape[-1])
            last_probs[r, :, :m] = probs.mean(dim=1)[:, :m]
    return out, lse


def expand_logit_scale(
    score_logit_scale: torch.Tensor, num_q_heads: int, num_kv_heads: int, total: int
) -> torch.Tensor:
    """[T], [Hkv, T] or [Hq, T] -> contiguous float32 [Hq, T]."""
    gain = score_logit_scale.float()
    if gain.dim() == 1:
        gain = gain[None].expand(num_q_heads, total)
    elif gain.shape[0] == num_kv_heads and num_kv_heads != num_q_heads:
        gain = gain.repeat_interleave(num_q_heads // num_kv_heads, dim=0)
    if tuple(gain.shape) != (num_q_heads, total):
        raise ValueError(
            f"score_logit_scale: expected [T], [Hkv, T] or [Hq, T] with T={total}, got {tuple(score_logit_scale.shape)}"
        )
    return gain.contiguous()


def prefill_attention_reference(
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
    need_output: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Causal varlen (chunked-)prefill attention plus the window queries' column sums.

    See `prefill_window.prefill_attention_with_window_sums` for the contract. Returns (out [T, Hq, D],
    window_sums [R, Hkv, slots] float32, lse [T, Hq] float32 of the unscaled logits). With `need_output=False` only
    the window queries are computed and (None, window_sums, None) is returned.
    """
    check_cache(key_cache, value_cache, contiguous_head=False)
    total, num_q_heads, dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    if window_sums is None:
        slots = max_slots if max_slots is not None else max(lens, default=0)
        window_sums = torch.zeros(len(lens), num_kv_heads, slots, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if need_output else None
    lse = torch.empty(total, num_q_heads, dtype=torch.float32, device=q.device) if need_output else None
    gain_rows = None
    if score_logit_scale is not None:
        gain_rows = expand_logit_scale(score_logit_scale.to(q.device), num_q_heads, num_kv_heads, total)
    for r, n in enumerate(lens):
        q0, q1 = starts[r], starts[r + 1]
        q_len = q1 - q0
        context = n - q_len
        first_window_row = q_len - min(window, q_len)
        keys, values = gather_entries(key_cache, value_cache, block_table[r], n)
        keys, values = keys.float(), values.float()
        sums = torch.zeros(num_kv_heads, n, dtype=torch.float32, device=q.device)
        for c0 in range(0 if need_output else first_window_row, q_len, QUERY_CHUNK):
            c1 = min(c0 + QUERY_CHUNK, q_len)
            rows = torch.arange(c0, c1, device=q.device)
            query = q[q0 + c0 : q0 + c1].float().reshape(c1 - c0, num_kv_heads, group, dim).permute(1, 2, 0, 3)
            logits = torch.einsum("hgqd,hnd->hgqn", query, keys) * scale
            visible = torch.arange(n, device=q.device)[None, :] <= (context + rows)[:, None]
            logits = logits.masked_fill(~visible, float("-inf"))
            if need_output:
                row_lse = torch.logsumexp(logits, dim=-1)
                probs = torch.exp(logits - row_lse[..., None])
                out[q0 + c0 : q0 + c1] = torch.einsum("hgqn,hnd->qhgd", probs, values).reshape(-1, num_q_heads, dim)
                lse[q0 + c0 : q0 + c1] = row_lse.permute(2, 0, 1).reshape(-1, num_q_heads)
            lo = max(first_window_row, c0)
            if lo >= c1:
                continue
            window_logits = logits[:, :, lo - c0 :]
            if gain_rows is not None:
                gain = gain_rows[:, q0 + lo : q0 + c1].reshape(num_kv_heads, group, -1, 1)
                window_logits = window_logits * gain
            sums += torch.softmax(window_logits, dim=-1).sum(dim=(1, 2))
        m = min(n, window_sums.shape[-1])
        if accumulate:
            window_sums[r, :, :m] += sums[:, :m]
        else:
            window_sums[r, :, :m] = sums[:, :m]
    return out, window_sums, lse


def compact_reference(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    keep_indices: torch.Tensor,
    *,
    keep_counts: torch.Tensor | None = None,
    stats: Sequence[torch.Tensor] = (),
) -> None:
    """In place: entry keep_indices[r, h, j] of request r, KV head h moves to slot j (j < keep_counts[r]).

    Copies out of place (advanced indexing gathers first), so it is correct whatever the overlap. `stats` are
    [R, H, slots] buffers whose rows move the same way. Slots at or past the count are left as they were.
    """
    check_cache(key_cache, value_cache, contiguous_head=False)
    num_reqs, num_heads, width = keep_indices.shape
    block_size = key_cache.shape[1]
    counts = keep_counts.tolist() if keep_counts is not None else [width] * num_reqs
    heads = torch.arange(num_heads, device=key_cache.device)[:, None]
    for r, count in enumerate(counts):
        if count == 0:
            continue
        keep = keep_indices[r, :, :count].long().to(key_cache.device)  # [H, B]
        row = block_table[r].long().to(key_cache.device)
        src_blocks, src_offsets = row[keep // block_size], keep % block_size
        dst = torch.arange(count, device=key_cache.device)
        dst_blocks = row[dst // block_size].expand(num_heads, -1)
        dst_offsets = (dst % block_size).expand(num_heads, -1)
        for cache in (key_cache, value_cache):
            cache[dst_blocks, dst_offsets, heads] = cache[src_blocks, src_offsets, heads]
        for stat in stats:
            stat[r, :, :count] = stat[r].gather(1, keep.to(stat.device))
