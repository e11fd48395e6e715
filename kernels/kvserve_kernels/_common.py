"""Small helpers shared by the Triton wrappers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreted(kernel: object) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (it then runs in Python on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def dot_settings(dtype: torch.dtype, kernel: object) -> tuple[bool, str]:
    """(DOT_F32, PRECISION) for a cache dtype.

    fp32 uses IEEE dots (tf32 would cost ~1e-3 relative error). Triton 3.9's interpreter returns garbage from
    `tl.dot` on bf16 operands, so under the interpreter bf16 tiles are upcast to fp32 first; compiled kernels keep
    bf16 tensor-core dots.
    """
    dot_f32 = dtype == torch.bfloat16 and interpreted(kernel)
    precision = "ieee" if dtype == torch.float32 or dot_f32 else "tf32"
    return dot_f32, precision


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


def check_buffer(
    name: str, buf: torch.Tensor | None, shape: tuple[int, ...], device: torch.device, min_last: bool = False
) -> None:
    """A float32 buffer with the given leading shape (last dim >= shape[-1] when `min_last`) and a contiguous last
    dimension, on `device`."""
    if buf is None:
        return
    lead_ok = tuple(buf.shape[:-1]) == shape[:-1] if min_last else tuple(buf.shape) == shape
    if buf.dim() != len(shape) or not lead_ok:
        raise ValueError(
            f"{name}: expected shape {shape}{' (last dim any)' if min_last else ''}, got {tuple(buf.shape)}"
        )
    if buf.dtype != torch.float32:
        raise ValueError(f"{name}: expected float32, got {buf.dtype}")
    if buf.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")
    if buf.device != device:
        raise ValueError(f"{name}: on {buf.device}, expected {device}")


@triton.jit
def load_kv_tile(
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
    PAGE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One tile of a request's keys and values through its block table: entries `offs_n`, [BLOCK_N, BLOCK_D] each.
    Entry i lives in block `bt_row[i // PAGE]`, slot `i % PAGE` (vLLM's slot mapping)."""
    block = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    slot = offs_n % PAGE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(
        K + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v
