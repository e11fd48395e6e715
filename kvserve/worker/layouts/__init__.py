"""How kvserve reads, scores and rewrites the page lists in a KV cache: one interface (`CachePages`), one
implementation per cache layout, chosen once per attention layer from the layout vLLM picked for it.

| layout | who picks it | implementation |
| --- | --- | --- |
| `vec` | vLLM's CPU backend, every dtype except bf16 with AMX tiles | `VecPages`: strided views, page-wise PyTorch |
| `amx` | vLLM's CPU backend, bf16 on a CPU with AMX tiles | `AmxPages`: decodes the pages it reads |
| `flash` | kvserve's own attention (`KVSERVE_ATTENTION=kernels`), the GPU path | `FlashPages`: the Triton kernels |

An fp8 cache (`--kv-cache-dtype fp8`) is stored in the `vec` or `amx` element order, a byte per entry:
`QuantisedPages` (`quantised.py`) wraps that layout, reading entries dequantised and moving kept ones as bytes.

The eviction step (`kvserve/worker/eviction.py`, `gated.py`, `allocated.py`) talks only to `CachePages`. Adding a
layout means one file here with a subclass that says how a page stores its keys and values.
"""

from __future__ import annotations

import torch

from kvserve.worker.layouts.amx import AmxPages
from kvserve.worker.layouts.base import CachePages
from kvserve.worker.layouts.flash import FlashPages, flash_views
from kvserve.worker.layouts.quantised import FP8_FORMATS, Fp8Codec, QuantisedPages
from kvserve.worker.layouts.views import PagedKV, VecPages, cpu_views

CPU_LAYOUTS: dict[str, type[CachePages]] = {"vec": VecPages, "amx": AmxPages}  # by vLLM's CPU attention ISA

__all__ = [
    "CPU_LAYOUTS",
    "AmxPages",
    "CachePages",
    "FP8_FORMATS",
    "FlashPages",
    "Fp8Codec",
    "PagedKV",
    "QuantisedPages",
    "VecPages",
    "cpu_views",
    "flash_views",
    "for_cache",
    "for_isa",
]


def for_isa(isa: str) -> type[CachePages]:
    """The implementation for the cache layout of vLLM's CPU attention ISA (`layer.isa`)."""
    try:
        return CPU_LAYOUTS[isa]
    except KeyError:
        raise RuntimeError(f"kvserve reads the CPU cache layouts {', '.join(CPU_LAYOUTS)}, not {isa!r}") from None


def for_cache(
    pages: torch.Tensor, isa: str, kv_cache_dtype: str = "auto", key_scale: float = 1.0, value_scale: float = 1.0
) -> CachePages:
    """The operations over one layer's page view: the layout of vLLM's ISA, read through the fp8 codec when the
    cache is quantised (vLLM's `kv_cache_dtype`, with the layer's scales)."""
    layout = for_isa(isa)(pages)
    if kv_cache_dtype == "auto":
        return layout
    return QuantisedPages(layout, Fp8Codec.for_cache(kv_cache_dtype, key_scale, value_scale))


def same_view(layout: CachePages | None, pages: torch.Tensor) -> bool:
    """Whether `layout` was made over exactly this page view (an attention layer keeps its layout across steps)."""
    return layout is not None and layout.pages is pages
