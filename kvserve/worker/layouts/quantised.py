"""fp8 KV caches (vLLM's `--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`): the same page layouts, one byte per entry.

vLLM 0.32's CPU backend stores an fp8 cache as uint8 in exactly the element order of the unquantised layout of the
same ISA ("vec": keys transposed per page; "amx": the 16-token / 16-dimension tiles), so the layout's own codec
addresses the bytes, and this wrapper only converts entries:

- read: `code.view(fp8) * scale` in float32 (vLLM's attention reads the cache with the layer's `k_scale` /
  `v_scale` the same way), so every statistic is computed from the keys the attention saw;
- write: `x * (1 / scale)` rounded toward zero to an fp8 value, which is what vLLM's cache writer stores
  (`tests/test_layouts.py` holds both to vLLM's writer, bit for bit, in both layouts). One exception seen: at a scale
  that is not 1, an entry whose `x * (1 / scale)` lands one float32 step below an fp8 subnormal value can be stored
  by vLLM one code higher. With the scales vLLM uses when a checkpoint brings none (1.0) there is none, and it only
  concerns entries kvserve writes itself (a merging policy's), never the ones it moves.

Compaction and page moves never decode: they move the stored bytes through the wrapped layout, so a kept entry is
bit for bit what vLLM wrote. Only new entries (a merging policy's rewritten ones) are encoded, and only those:
re-encoding a decoded entry need not give its byte back when the scale is not a power of 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.worker.layouts.base import CachePages

# vLLM's cache dtype names for fp8 (vLLM 0.32 `CPUAttentionBackend.supported_kv_cache_dtypes`; "fp8" is e4m3)
FP8_FORMATS: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Fp8Codec:
    """One layer's fp8 format and scales (vLLM's `layer._k_scale_float`, `layer._v_scale_float`)."""

    format: torch.dtype
    key_scale: float = 1.0
    value_scale: float = 1.0

    @classmethod
    def for_cache(cls, kv_cache_dtype: str, key_scale: float = 1.0, value_scale: float = 1.0) -> Fp8Codec:
        try:
            return cls(FP8_FORMATS[kv_cache_dtype], float(key_scale), float(value_scale))
        except KeyError:
            raise RuntimeError(
                f"kvserve reads the KV cache dtypes auto, {', '.join(FP8_FORMATS)}; not {kv_cache_dtype!r}"
            ) from None

    def decode(self, stored: torch.Tensor, scale: float) -> torch.Tensor:
        """Stored bytes -> float32 entries."""
        return stored.view(self.format).float() * scale

    def encode(self, entries: torch.Tensor, scale: float) -> torch.Tensor:
        """float entries -> stored bytes, rounded toward zero as vLLM's CPU cache writer rounds."""
        # times the float32 reciprocal, as vLLM's writer computes it (x / scale can land on the other side of an
        # fp8 value, where truncation then differs)
        exact = entries.float() * torch.tensor(scale, dtype=torch.float32).reciprocal()
        nearest = exact.to(self.format)
        code = nearest.view(torch.uint8)
        # the nearest fp8 value lies one step further from zero than `exact`: take the next code toward zero (fp8
        # is sign-magnitude, so for either sign that is the magnitude bits minus one)
        overshoots = nearest.float().abs() > exact.abs()
        return torch.where(overshoots, code - 1, code)


class QuantisedPages(CachePages):
    """A layout's operations over an fp8 cache: entries read as float32, kept entries moved as bytes."""

    def __init__(self, stored: CachePages, codec: Fp8Codec) -> None:
        super().__init__(stored.pages)
        self.stored = stored  # the same pages, addressed as bytes by the unquantised layout's codec
        self.codec = codec
        self.name = f"{stored.name}-fp8"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # what reads return

    def key_pages(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(self.stored.key_pages(ids), self.codec.key_scale)

    def value_pages(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(self.stored.value_pages(ids), self.codec.value_scale)

    def store_pages(self, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.stored.store_pages(ids, *self._encode(keys, values))

    def compact(
        self,
        tables: torch.Tensor,
        keep_indices: torch.Tensor,
        keep_counts: torch.Tensor,
        stats: Sequence[torch.Tensor] = (),
        entries: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        # the caller's entries are decoded: the bytes are read again so that the kept entries move unchanged
        self.stored.compact(tables, keep_indices, keep_counts, stats)

    def write_lists(self, tables: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.stored.write_lists(tables, *self._encode(keys, values))

    def write_slots(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.stored.write_slots(slots, *self._encode(keys, values))

    def _encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec.encode(keys, self.codec.key_scale), self.codec.encode(values, self.codec.value_scale)
