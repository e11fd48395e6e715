"""One function per GPU-path operation: the Triton kernel for CUDA tensors, the PyTorch reference otherwise.

The kernels and references live in the `kvserve_kernels` package (the repository's `kernels/` folder); the layout
they read is vLLM 0.32's FlashAttention cache, split into key/value views by `split_kv_cache`
(see `kvserve_kernels.layout`). `backend` overrides the choice per call, the environment variable
`KVSERVE_KERNELS` ("auto", "triton", "torch") for the process; "triton" on CPU tensors needs `TRITON_INTERPRET=1`
set before the kernel modules are first imported (the interpreter tests do this).

Imports are lazy: importing this module needs neither Triton nor `kvserve_kernels`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch

from kvserve.environment import declared

Backend = Literal["auto", "triton", "torch"]
BACKEND_ENV = declared("KVSERVE_KERNELS")
ATTENTION_ENV = declared("KVSERVE_ATTENTION")
ATTENTION_MODES = ("vllm", "kernels")


def attention_mode() -> str:
    """Who computes a layer's attention in the engine: `vllm` (the default: vLLM's CPU kernel, then kvserve's
    statistics from the same cache, kvserve/vllm/attention.py) or `kernels` (kvserve's own attention gives output
    and statistics from one of the operations below, kvserve/vllm/kernel_attention.py)."""
    mode = os.environ.get(ATTENTION_ENV, "vllm")
    if mode not in ATTENTION_MODES:
        raise ValueError(f"{ATTENTION_ENV} must be one of {', '.join(ATTENTION_MODES)}, got {mode!r}")
    return mode


def use_triton(device: torch.device, backend: Backend = "auto") -> bool:
    """True when the call should run the Triton kernel: forced by `backend` or $KVSERVE_KERNELS, else on CUDA."""
    choice = backend if backend != "auto" else os.environ.get(BACKEND_ENV, "auto")
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel backend must be auto, triton or torch, got {choice!r}")
    if choice == "auto":
        return device.type == "cuda"
    return choice == "triton"


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache [num_blocks, num_kv_heads, block_size, 2 * head_size] -> (keys, values) views
    [num_blocks, block_size, num_kv_heads, head_size], as `FlashAttentionImpl.forward` splits it."""
    from kvserve_kernels.layout import split_kv_cache as split

    return split(kv_cache, head_size)


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
    need_output: bool = True,
    backend: Backend = "auto",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Decode attention (one query per request) with H2O / TOVA / MAT statistics from the same pass.

    q [R, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_table [R, max_blocks] int32; seq_lens [R] int32.
    `scores` [R, Hkv, S] float32 += probabilities summed over each KV head's query heads; `last_probs`
    [R, Hkv, S] float32 = their mean over the group; `first_logit` [R, Hq] float32 = q.k_0 * scale.
    Returns (out [R, Hq, D], lse [R, Hq] float32). `need_output=False`: the caller has the output already (kvserve's
    CPU path, after vLLM's kernel); the PyTorch path then computes only the statistics and returns (None, None), the
    fused kernel computes everything anyway. Full contract:
    `kvserve_kernels.decode_attention.decode_attention_with_scores`.
    """
    if use_triton(q.device, backend):
        from kvserve_kernels.decode_attention import decode_attention_with_scores as kernel

        return kernel(
            q,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            scale,
            scores=scores,
            last_probs=last_probs,
            first_logit=first_logit,
            max_seq_len=max_seq_len,
            num_splits=num_splits,
        )
    from kvserve_kernels.reference import decode_attention_reference

    return decode_attention_reference(
        q,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        scale,
        scores=scores,
        last_probs=last_probs,
        first_logit=first_logit,
        need_output=need_output,
    )


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
    need_output: bool = True,
    backend: Backend = "auto",
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Causal varlen (chunked-)prefill attention plus the column sums of the last `window` queries' probabilities.

    q [T, Hq, D]; query_start_loc [R + 1] int32; the chunk's entries already in the cache. `window_sums`
    [R, Hkv, S] float32 gets (or, with `accumulate`, adds) each entry's probability summed over the window queries
    and the group's query heads; `score_logit_scale` ([T], [Hkv, T] or [Hq, T]) sharpens the logits of the sums
    only (AhaKV's step gain). Returns (out [T, Hq, D], window_sums, lse [T, Hq] float32); `need_output=False` as in
    `decode_attention_with_scores` (the PyTorch path then computes only the window queries). Full contract:
    `kvserve_kernels.prefill_window.prefill_attention_with_window_sums`.
    """
    if use_triton(q.device, backend):
        from kvserve_kernels.prefill_window import prefill_attention_with_window_sums as kernel

        return kernel(
            q,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            query_start_loc,
            scale,
            window,
            window_sums=window_sums,
            accumulate=accumulate,
            score_logit_scale=score_logit_scale,
            max_slots=max_slots,
            max_seq_len=max_seq_len,
            max_query_len=max_query_len,
        )
    from kvserve_kernels.reference import prefill_attention_reference

    return prefill_attention_reference(
        q,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        window,
        window_sums=window_sums,
        accumulate=accumulate,
        score_logit_scale=score_logit_scale,
        max_slots=max_slots,
        need_output=need_output,
    )


def compact(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    keep_indices: torch.Tensor,
    *,
    keep_counts: torch.Tensor | None = None,
    stats: Sequence[torch.Tensor] = (),
    backend: Backend = "auto",
) -> None:
    """In place: for request r and KV head h, entry keep_indices[r, h, j] (strictly ascending in j) moves to slot j
    of the request's blocks (j < keep_counts[r], default all), and every `stats` buffer [R, Hkv, slots] moves its
    rows the same way. One layer per call. Full contract: `kvserve_kernels.compaction.compact`.
    """
    if use_triton(key_cache.device, backend):
        from kvserve_kernels.compaction import compact as kernel

        kernel(key_cache, value_cache, block_table, keep_indices, keep_counts=keep_counts, stats=stats)
        return
    from kvserve_kernels.reference import compact_reference

    compact_reference(key_cache, value_cache, block_table, keep_indices, keep_counts=keep_counts, stats=stats)
