"""Test pages in vLLM's CPU cache formats, written by vLLM's own cache-write op where it runs on this CPU.

vLLM 0.32's CPU ops are built per ISA: on an AVX2-only CPU its AMX writer raises ("Unsupported CPU attention
configuration ... isa=0"). There the AMX pages are written by kvserve's own AMX codec (`AmxPages.write_slots`), which
tests/test_layouts.py holds to vLLM's writer bit for bit wherever that writer runs, so the AMX layout's operations
are still tested on every machine."""

from __future__ import annotations

import functools
import os

import torch

from kvserve.cpu_dtype import cpu_flags
from kvserve.worker.layouts import AmxPages


def write_with_vllm(
    pages: torch.Tensor,
    isa: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    cache: str = "auto",
    scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """vLLM's cache-write op for `isa`: keys/values [m, D] at page-view slots [m] of pages [P, 1, bs, 2D]. An fp8
    `cache` (pages in uint8) takes the keys and values in their model dtype, quantised with `scales`."""
    from vllm import _custom_ops as ops

    key_cache, value_cache = pages.view(pages.shape[0], 1, 2 * pages.shape[2], -1).chunk(2, dim=2)
    dtype = pages.dtype if cache == "auto" else keys.dtype
    ops.cpu_attn_reshape_and_cache(
        keys.to(dtype)[:, None],
        values.to(dtype)[:, None],
        key_cache,
        value_cache,
        slots,
        isa,
        k_scale=scales[0],
        v_scale=scales[1],
        kv_cache_dtype=cache,
    )


def fp8_reference(entries: torch.Tensor, fmt: torch.dtype, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What an fp8 cache holds for `entries`, found by search rather than by conversion: of all 256 codes, the one
    whose value is the largest in magnitude not past `entries * (1 / scale)`, on its side of zero (vLLM's writer rounds
    toward zero). Returns (codes as uint8, the entries they read back as: value * scale, float32)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    table = codes.view(fmt).float()
    exact = entries.float() * (1 / torch.tensor(scale, dtype=torch.float32))  # vLLM's writer: the reciprocal, float32
    table = torch.where(torch.isfinite(table), table, torch.zeros_like(table))  # NaN / inf codes are never chosen
    fits = (table.abs() <= exact.abs()[..., None]) & (torch.signbit(table) == torch.signbit(exact)[..., None])
    magnitude = torch.where(fits, table.abs(), torch.full_like(table, -1.0))
    best = magnitude.argmax(dim=-1)  # one code per magnitude and sign (the NaN codes read as +0 come later)
    chosen = codes[best]
    return chosen, table[best] * scale


@functools.cache
def vllm_cannot_write_fp8(isa: str) -> str | None:
    """Why vLLM's fp8 cache writer for `isa` does not run on this CPU (vLLM's CPU fp8 cache needs AVX-512 or AMX)."""
    try:
        write_with_vllm(
            torch.zeros(1, 1, 32, 128, dtype=torch.uint8),
            isa,
            torch.ones(1, 64, dtype=torch.bfloat16),
            torch.ones(1, 64, dtype=torch.bfloat16),
            torch.zeros(1, dtype=torch.long),
            cache="fp8",
        )
    except RuntimeError as error:
        flags = sorted(flag for flag in cpu_flags() if flag.startswith(("avx512f", "amx")))
        return f"vLLM's {isa} fp8 cache writer does not run on this CPU ({', '.join(flags) or 'no AVX-512'}): {error}"
    return None


@functools.cache
def vllm_cannot_write(isa: str) -> str | None:
    """Why vLLM's cache writer for `isa` does not run on this CPU, naming its flags (None: it runs).
    `KVSERVE_TESTS_WITHOUT_VLLM_AMX=1` takes vLLM's AMX writer away, as an AVX2-only CPU does."""
    if isa == "amx" and os.environ.get("KVSERVE_TESTS_WITHOUT_VLLM_AMX"):
        return "vLLM's amx cache writer taken away (KVSERVE_TESTS_WITHOUT_VLLM_AMX), as on an AVX2-only CPU"
    dtype = torch.bfloat16 if isa == "amx" else torch.float32
    try:
        write_with_vllm(
            torch.zeros(1, 1, 32, 128, dtype=dtype),
            isa,
            torch.ones(1, 64),
            torch.ones(1, 64),
            torch.zeros(1, dtype=torch.long),
        )
    except RuntimeError as error:
        flags = sorted(flag for flag in cpu_flags() if flag.startswith(("avx512f", "avx512_bf16", "amx")))
        return (
            f"vLLM's {isa} cache writer does not run on this CPU ({', '.join(flags) or 'no AVX-512, no AMX'}): {error}"
        )
    return None


def write(pages: torch.Tensor, isa: str, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Keys/values [m, D] at page-view slots [m] in the `isa` format: vLLM's writer, or kvserve's AMX codec where
    vLLM's AMX writer cannot run."""
    if isa == "amx" and vllm_cannot_write("amx"):
        AmxPages(pages).write_slots(slots, keys.to(pages.dtype), values.to(pages.dtype))
    else:
        write_with_vllm(pages, isa, keys, values, slots)
