"""Which parallel layouts kvserve can serve; imported by `kvserve serve` before vLLM starts, so it imports nothing
heavy (the CLI would otherwise pay vLLM's import once more before it execs the server)."""

from __future__ import annotations


def parallelism_refusal(tensor_parallel_size: int, decode_context_parallel_size: int = 1) -> str | None:
    """Why kvserve cannot serve this parallel layout correctly, or None. Pipeline and data parallelism work: each
    stage evicts its own layers and passes its page counts down the pipeline (`kvserve/worker/stages.py`); each
    data-parallel engine is a whole kvserve engine. Under tensor parallelism every rank would evict its own KV
    heads in the same blocks, but only rank 0's page report reaches the scheduler and the ranks would not agree on
    the blocks to give back, so it is refused rather than served with leaked or overwritten pages."""
    if tensor_parallel_size > 1:
        return (
            f"kvserve eviction does not support tensor parallelism (--tensor-parallel-size "
            f"{tensor_parallel_size}): each rank would evict its own KV heads, but the ranks do not yet agree on "
            "the blocks to give back. Use --pipeline-parallel-size to split the model, or run vanilla vLLM "
            "(VLLM_PLUGINS without 'kvserve')."
        )
    if decode_context_parallel_size > 1:
        return (
            f"kvserve eviction does not support decode context parallelism (--decode-context-parallel-size "
            f"{decode_context_parallel_size}): its KV cache is split by token across ranks."
        )
    return None
