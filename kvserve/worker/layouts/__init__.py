"""How kvserve reads, scores and rewrites the page lists in a KV cache: one interface (`CachePages`), one
implementation per cache layout, chosen once per attention layer from the layout vLLM picked for it.

| layout | who picks it | implementation |
| --- | --- | --- |
| `vec` | vLLM's CPU backend, every dtype except bf16 with AMX tiles | `VecPages`: strided views, page-wise PyTorch |
| `amx` | vLLM's CPU backend, bf16 on a CPU with AMX tiles | `AmxPages`: decodes the pages it reads |
| `flash` | kvserve's own attention (`KVSERVE_ATTENTION=kernels`), the GPU path | `FlashPages`: the Triton kernels |

The eviction step (`kvserve/worker/eviction.py`, `gated.py`, `allocated.py`) talks only to `CachePages`. Adding a
layout means one file here with a subclass that says how a page stores its keys and values.
"""

from __future__ import annotations

import torch

from kvserve.worker.layouts.amx import AmxPages
from kvserve.worker.layouts.base import CachePages
from kvserve.worker.layouts.flash import FlashPages, flash_views
from kvserve.worker.layouts.views import PagedKV, VecPages, cpu_views

CPU_LAYOUTS: dict[str, type[CachePages]] = {"vec": VecPages, "amx": AmxPages}  # by vLLM's CPU attention ISA

__all__ = [
    "CPU_LAYOUTS",
    "AmxPages",
    "CachePages",
    "FlashPages",
    "PagedKV",
    "VecPages",
    "cpu_views",
    "flash_views",
    "for_isa",
]


def for_isa(isa: str) -> type[CachePages]:
    """The implementation for the cache layout of vLLM's CPU attention ISA (`layer.isa`)."""
    try:
        return CPU_LAYOUTS[isa]
    except KeyError:
        raise RuntimeError(f"kvserve reads the CPU cache layouts {', '.join(CPU_LAYOUTS)}, not {isa!r}") from None


def same_view(layout: CachePages | None, pages: torch.Tensor) -> bool:
    """Whether `layout` was made over exactly this page view (an attention layer keeps its layout across steps)."""
    return layout is not None and layout.pages is pages
