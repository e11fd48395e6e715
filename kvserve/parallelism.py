"""Which parallel layouts kvserve can serve; imported by `kvserve serve` before vLLM starts, so it imports nothing
heavy (the CLI would otherwise pay vLLM's import once more before it execs the server)."""

from __future__ import annotations


def parallelism_refusal(
    tensor_parallel_size: int, decode_context_parallel_size: int = 1, num_kv_heads: int | None = None
) -> str | None:
    """Why kvserve cannot serve this parallel layout correctly, or None.

    Pipeline, tensor and data parallelism work. Each pipeline stage evicts its own layers and each tensor-parallel
    rank its own KV heads, all in the SAME vLLM blocks; the workers agree on the blocks a request gives back before
    any is (`kvserve/worker/ranks.py`, `kvserve/worker/stages.py`). Each data-parallel engine is a whole kvserve
    engine. With more ranks than KV heads (`num_kv_heads`, when known) vLLM replicates a KV head on several ranks,
    each scoring it with other query heads: their copies would keep different entries, so that is refused."""
    if num_kv_heads is not None and tensor_parallel_size > num_kv_heads:
        return (
            f"kvserve eviction does not support more tensor-parallel ranks ({tensor_parallel_size}) than the model "
            f"has KV heads ({num_kv_heads}): vLLM would copy each KV head to several ranks, which would score it with "
            f"different query heads and keep different entries. Use --tensor-parallel-size {num_kv_heads} or a "
            "divisor of it, or run vanilla vLLM (VLLM_PLUGINS without 'kvserve')."
        )
    if decode_context_parallel_size > 1:
        return (
            f"kvserve eviction does not support decode context parallelism (--decode-context-parallel-size "
            f"{decode_context_parallel_size}): its KV cache is split by token across ranks."
        )
    return None
