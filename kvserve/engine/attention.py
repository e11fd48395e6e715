"""The attention backend: vLLM's CPU attention, then kvserve's scoring and compaction in the same layer pass.

The stock kernel returns no probabilities, so the statistics a policy needs are computed right after it from the
cache the kernel just read (only for evicting requests, only the rows a policy needs). Compaction happens here too,
after this layer's attention for the step is done, so the step's output is unaffected and the next step reads the
compacted cache.
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from kvserve.engine.cache_layout import cpu_views, stage_blocks
from kvserve.engine.worker_state import current_step
from kvserve.kernel_dispatch import attention_mode

SUPPORTED_ISAS = ("vec", "amx")  # the cache layouts kvserve reads and compacts (kvserve/engine/cache_layout.py)


def layer_index(layer) -> int:
    """The model layer an attention layer belongs to, parsed from its name once and kept on it."""
    index = getattr(layer, "_kvserve_layer_idx", None)
    if index is None:
        index = layer._kvserve_layer_idx = extract_layer_index(layer.layer_name)
    return index


class KVServeAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM picks the kernel ISA, and with it the cache layout, once per KV-cache group at engine start ("amx" for
    bf16 on a CPU with AMX tiles, "vec" otherwise). Any layout kvserve cannot read is refused here, at start-up, with
    the reason, rather than failing the first evicting request inside a forward pass."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa not in SUPPORTED_ISAS or self.kv_cache_dtype != "auto":
            raise RuntimeError(
                f"kvserve eviction supports the CPU cache layout of ISA {SUPPORTED_ISAS} with an unquantised cache; "
                f"this engine would use ISA {self.isa!r} (head size {self.head_dim}, block size {self.block_size}) and "
                f"kv_cache_dtype {self.kv_cache_dtype!r}. Use a block size that is a multiple of 32, no fp8 cache, "
                "or run vanilla vLLM (VLLM_PLUGINS without 'kvserve')."
            )


class KVServeAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        step = current_step()
        if step is None or not step.rows or attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return result
        layer_idx = layer_index(layer)
        if getattr(layer, "isa", "vec") != "amx":
            step.after_attention(layer_idx, query, cpu_views(kv_cache), attn_metadata.block_table, self.scale, result)
            return result
        # AMX blocks: no view addresses an entry, so the blocks this step reads are decoded into views first, and
        # written back if a compaction rewrote them. Steps that only record window queries copy nothing.
        rows = step.cache_rows()
        if not rows:
            step.after_attention(layer_idx, query, None, attn_metadata.block_table, self.scale, result)
            return result
        staged = stage_blocks(kv_cache, attn_metadata.block_table, rows)
        step.after_attention(layer_idx, query, staged.cache, staged.block_table, self.scale, result)
        if step.compacts():
            staged.write_back(kv_cache)
        return result


class KVServeAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVServeAttentionImpl]:
        if attention_mode() == "kernels":
            from kvserve.engine.kernel_attention import KVServeKernelAttentionImpl

            return KVServeKernelAttentionImpl
        return KVServeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVServeAttentionMetadataBuilder]:
        return KVServeAttentionMetadataBuilder
