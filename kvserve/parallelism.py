"""Which parallel layouts kvserve can serve; imported by `kvserve serve` before vLLM starts, so it imports nothing
heavy (the CLI would otherwise pay vLLM's import once more before it execs the server)."""

from __future__ import annotations

import os


def parallelism_refusal(
    tensor_parallel_size: int, decode_context_parallel_size: int = 1, num_kv_heads: int | None = None
) -> str | None:
    """Why kvserve cannot serve this parallel layout correctly, or None.

    Pipeline, tensor and data parallelism work. Each pipeline stage evicts its own layers and each tensor-parallel
    rank its own KV heads, all in the SAME vLLM blocks; the workers agree on the blocks a request gives back before
    any is (`kvserve/worker/ranks.py`, `kvserve/worker/stages.py`). Each data-parallel engine of
    `--data-parallel-size` is a whole kvserve engine (tests/test_data_parallel.py); vLLM itself refuses its
    external-balancer layout (`--data-parallel-rank`) for dense models, whose servers go behind vLLM's router.
    With more ranks than KV heads (`num_kv_heads`, when known) vLLM replicates a KV head on several ranks, each
    scoring it with other query heads: their copies would keep different entries, so that is refused."""
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


# Speculative methods kvserve serves with eviction. n-gram prompt lookup proposes from the token ids alone. A draft
# model (vLLM's DraftModelProposer) and an EAGLE or EAGLE-3 head (EagleProposer: a layer fed the target's hidden
# states) keep a KV cache of their own in their layers' share of the request's blocks, which they address by vLLM's
# block table: those layers stay vLLM's (`kvserve.vllm.model.is_drafter_name`), and a request that has compacted,
# whose block table no longer maps its positions, is given no drafts (`drafts_allowed`). Until then the target's
# hidden states are vanilla's (nothing was evicted), so a head drafts what it drafts in vanilla vLLM.
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
OWN_CACHE_METHODS = ("draft_model", "eagle", "eagle3")  # drafters with a KV cache of their own, in vLLM's layout


def speculation_refusal(
    speculative_config, pipeline_parallel_size: int = 1, attention_mode: str = "vllm"
) -> str | None:
    """Why kvserve cannot evict beside this `--speculative-config`, or None (none given, n-gram, a draft model, an
    EAGLE or EAGLE-3 head).
    `attention_mode`: KVSERVE_ATTENTION's, whose `kernels` keeps every paged layer's cache in its own layout."""
    if speculative_config is None:
        return None
    method = speculative_config.method
    if method not in SPECULATIVE_METHODS:
        return (
            f"kvserve eviction serves speculative decoding by n-gram prompt lookup ('ngram'), a draft model "
            f"('draft_model') and an EAGLE head ('eagle', 'eagle3'), not {method!r}: its drafter is not verified "
            "with eviction (MTP's layers come with the target's own checkpoint, which no model kvserve was tested on "
            "has). Use one of those, or run vanilla vLLM (VLLM_PLUGINS without 'kvserve')."
        )
    if pipeline_parallel_size > 1:
        return "kvserve eviction does not serve speculative decoding under pipeline parallelism"
    if method in OWN_CACHE_METHODS and attention_mode == "kernels":
        return (
            f"kvserve eviction serves {method!r} with vLLM's CPU attention only (KVSERVE_ATTENTION=vllm, the "
            "default): the drafter's layers attend with vLLM's own ops over vLLM's cache layout"
        )
    return None


def drafter_has_own_cache(speculative_config) -> bool:
    """Whether the drafter keeps a KV cache of its own (a draft model, an EAGLE or EAGLE-3 head): a compacted request
    then gets no drafts."""
    return speculative_config is not None and speculative_config.method in OWN_CACHE_METHODS


def flag_value(args: list[str], *names: str) -> str | None:
    """The value of a vLLM flag given as `--flag V` or `--flag=V` (the last one wins, as in argparse)."""
    value = None
    for index, arg in enumerate(args):
        for name in names:
            if arg == name and index + 1 < len(args):
                value = args[index + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def local_engines(vllm_args: list[str]) -> int:
    """How many data-parallel engines this server starts on this machine: `--data-parallel-size-local`, else all of
    `--data-parallel-size` (vLLM's internal balancer on one node), and one for an engine of the external-balancer
    layout (`--data-parallel-rank R`: one server per engine, each bound by whoever starts it)."""
    if flag_value(vllm_args, "--data-parallel-rank", "-dpn") is not None:
        return 1
    local = flag_value(vllm_args, "--data-parallel-size-local", "-dpl")
    return int(local if local is not None else flag_value(vllm_args, "--data-parallel-size", "-dp") or 1)


def parallel_env(vllm_args: list[str], env: dict) -> dict[str, str]:
    """CPUs for each worker of a parallel layout (see `parallelism_refusal` for what is refused): vLLM's CPU
    workers, one per data-parallel engine, pipeline stage and tensor-parallel rank, each need CPUs of their own, and
    vLLM only finds them by itself on a machine with a NUMA node per worker (two engines on one NUMA node were both
    bound to its first CPU), so kvserve splits this process's CPUs into one group per worker, in vLLM's order: engine
    0's workers (the ranks of stage 0, then stage 1, ...), then engine 1's."""
    tensor = int(flag_value(vllm_args, "--tensor-parallel-size", "-tp") or 1)
    refusal = parallelism_refusal(tensor, int(flag_value(vllm_args, "--decode-context-parallel-size", "-dcp") or 1))
    if refusal is not None:
        raise SystemExit(refusal)  # it names kvserve already
    stages = int(flag_value(vllm_args, "--pipeline-parallel-size", "-pp") or 1)
    engines = local_engines(vllm_args)
    # a model split over --nnodes machines has world size / nnodes of its workers on this one (vLLM's rule)
    nodes = int(flag_value(vllm_args, "--nnodes", "-n") or 1)
    workers = max(1, engines * stages * tensor // nodes)
    if workers == 1 or "VLLM_CPU_OMP_THREADS_BIND" in env:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < workers:
        raise SystemExit(
            f"kvserve: {engines} data-parallel engine(s) x --pipeline-parallel-size {stages} x "
            f"--tensor-parallel-size {tensor} over {nodes} node(s) needs a CPU per worker on this node ({workers}); "
            f"this process may use {len(cpus)}"
        )
    share = len(cpus) // workers
    groups = [cpus[worker * share : (worker + 1) * share] for worker in range(workers)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(str(cpu) for cpu in group) for group in groups)}
