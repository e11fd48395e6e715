"""The attention backend kvserve registers for vLLM's CPU platform: vLLM's CPU backend with kvserve's metadata
check and one of two implementations, chosen once at engine start by `KVSERVE_ATTENTION`:
`vllm` (default, `attention.py`: vLLM's CPU ops over head pages) or `kernels` (`kernel_attention.py`: kvserve's own
operations, the GPU path)."""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadataBuilder
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvserve.model_support import eviction_support
from kvserve.vllm.attention import KVServeAttentionImpl
from kvserve.vllm.kernel_attention import KVServeKernelAttentionImpl
from kvserve.worker.kernel_dispatch import attention_mode
from kvserve.worker.layouts import FP8_FORMATS

SUPPORTED_ISAS = ("vec", "amx")  # the cache layouts kvserve reads and compacts (kvserve/worker/layouts/)


def readable_cache_dtypes(mode: str) -> tuple[str, ...]:
    """The `--kv-cache-dtype` values kvserve's attention `mode` reads and compacts: vLLM's ops read an fp8 cache
    (`kvserve/worker/layouts/quantised.py`); kvserve's own kernels read the unquantised FlashAttention layout only."""
    return ("auto", *FP8_FORMATS) if mode == "vllm" else ("auto",)


class KVServeAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM picks the kernel ISA, and with it the cache layout, once per KV-cache group at engine start ("amx" for
    bf16 on a CPU with AMX tiles, "vec" otherwise; an fp8 cache keeps the ISA's element order). Any layout or cache
    dtype kvserve cannot read in the group it pages is refused here, at start-up, with the reason, rather than
    failing the first evicting request inside a forward pass. (The other groups, and every group of a model that
    does not evict, stay vLLM's.)"""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        pages = type(kv_cache_spec) is FullAttentionSpec and eviction_support(vllm_config.model_config).evicts
        if not pages:
            return
        readable = readable_cache_dtypes(attention_mode())
        if self.isa not in SUPPORTED_ISAS or self.kv_cache_dtype not in readable:
            raise RuntimeError(
                f"kvserve eviction supports the CPU cache layouts of ISA {SUPPORTED_ISAS} with the cache dtypes "
                f"{readable} (KVSERVE_ATTENTION={attention_mode()}); this engine would use ISA {self.isa!r} (head "
                f"size {self.head_dim}, block size {self.block_size}) and kv_cache_dtype {self.kv_cache_dtype!r}. Use "
                "a block size that is a multiple of 32, one of those cache dtypes, or run vanilla vLLM (VLLM_PLUGINS "
                "without 'kvserve')."
            )


class KVServeAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[KVServeAttentionImpl] | type[KVServeKernelAttentionImpl]:
        return KVServeKernelAttentionImpl if attention_mode() == "kernels" else KVServeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVServeAttentionMetadataBuilder]:
        return KVServeAttentionMetadataBuilder
