"""Small helpers shared by the Triton wrappers."""

from __future__ import annotations

import torch
import triton


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


def check_buffer(name: str, buf: torch.Tensor | None, shape: tuple[int, ...], device: torch.device,
                 min_last: bool = False) -> None:
    """A float32 buffer with the given leading shape (last dim >= shape[-1] when `min_last`) and a contiguous last
    dimension, on `device`."""
    if buf is None:
        return
    lead_ok = tuple(buf.shape[:-1]) == shape[:-1] if min_last else tuple(buf.shape) == shape
    if buf.dim() != len(shape) or not lead_ok:
        raise ValueError(f"{name}: expected shape {shape}{' (last dim any)' if min_last else ''}, "
                         f"got {tuple(buf.shape)}")
    if buf.dtype != torch.float32:
        raise ValueError(f"{name}: expected float32, got {buf.dtype}")
    if buf.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")
    if buf.device != device:
        raise ValueError(f"{name}: on {buf.device}, expected {device}")
