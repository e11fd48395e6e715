"""Every place kvserve depends on vLLM's internals, in one table, checked at start-up.

`POINTS` lists each vLLM function kvserve wraps, overrides in a subclass, or calls although vLLM keeps it private,
with the parameters it was written against (vLLM 0.32.0). `check` compares each with the installed vLLM before
anything is patched, and fails naming the point and the version, so that a vLLM release that moved one of them
stops kvserve at start-up instead of misbehaving in the first request. `ATTRIBUTES` lists what kvserve reads or
plants on vLLM's objects beyond their methods.

How: `wrapped` (vLLM's function replaced by one that calls it, `kvserve/vllm/patches.py`), `overridden` (a method
of kvserve's subclass: `EvictingScheduler`, `EvictingFullAttentionManager`, the attention backend), `called` (a
private or internal function kvserve calls). Group: `engine` points are checked in every vLLM process, `api` points
where the API server runs (its modules are only loaded there).
"""

from __future__ import annotations

import enum
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
MANAGER = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager"
CPU_ATTENTION = "vllm.v1.attention.backends.cpu_attn"


@dataclass(frozen=True)
class Point:
    name: str  # kvserve's name for it (errors and docs use it)
    target: str  # "module:Qualified.name" in vLLM
    signature: str  # its parameters as kvserve was written against them (`signature_of`)
    how: str  # wrapped | overridden | called
    by: str  # kvserve's side of it
    group: str = "engine"  # engine | api


def _p(name: str, target: str, signature: str, how: str, by: str, group: str = "engine") -> Point:
    return Point(name, target, signature, how, by, group)


POINTS: tuple[Point, ...] = (
    # which scheduler and attention backend vLLM builds (kvserve/vllm/patches.py)
    _p("attention_backend", "vllm.v1.attention.backends.registry:register_backend",
       "(backend, class_path=None, is_mamba=False)", "called", "patches._register_attention_backend"),
    _p("scheduler_choice", "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls", "(self)", "wrapped",
       "patches._patch_scheduler_choice"),
    # the worker's step: page lists in step with vLLM's blocks, the step context, reports (kvserve/vllm/worker.py)
    _p("update_states", f"{RUNNER}._update_states", "(self, scheduler_output)", "wrapped",
       "worker.before_update_states"),
    _p("prepare_inputs", f"{RUNNER}._prepare_inputs", "(self, scheduler_output, num_scheduled_tokens)", "wrapped",
       "worker.after_prepare_inputs"),
    _p("execute_model", f"{RUNNER}.execute_model", "(self, scheduler_output, intermediate_tensors=None)", "wrapped",
       "worker.after_forward"),
    _p("sample_tokens", f"{RUNNER}.sample_tokens", "(self, grammar_output)", "wrapped", "worker.report_step"),
    # seeded sampling on CPU across partial prefills, and pipeline buffers without a warm-up (kvserve/vllm/patches.py)
    _p("seeded_sample", f"{RUNNER}._sample", "(self, logits, spec_decode_metadata)", "wrapped",
       "patches._patch_seeded_sampling"),
    _p("seeded_bookkeeping", f"{RUNNER}._bookkeeping_sync",
       "(self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens)", "wrapped",
       "patches._patch_seeded_sampling"),
    _p("pipeline_buffers", f"{RUNNER}.sync_and_gather_intermediate_tensors",
       "(self, num_tokens, intermediate_tensors, sync_self)", "wrapped", "patches._patch_pipeline_buffers"),
    # the engine core: when and how much requests compact, and what they are charged (kvserve/vllm/scheduler.py and
    # kv_cache_manager.py)
    _p("scheduler_init", f"{SCHEDULER}.__init__",
       "(self, vllm_config, kv_cache_config, structured_output_manager, block_size, hash_block_size=None, "
       "mm_registry=..., include_finished_set=False, log_stats=False)", "overridden", "EvictingScheduler"),
    _p("scheduler_add_request", f"{SCHEDULER}.add_request", "(self, request)", "overridden", "EvictingScheduler"),
    _p("scheduler_schedule", f"{SCHEDULER}.schedule", "(self, throttle_prefills=False)", "overridden",
       "EvictingScheduler"),
    _p("scheduler_update", f"{SCHEDULER}.update_from_output", "(self, scheduler_output, model_runner_output)",
       "overridden", "EvictingScheduler"),
    _p("chunk_end", f"{SCHEDULER}._reserve_prefill_lookahead", "(self, request, num_computed_tokens, num_new_tokens)",
       "overridden", "EvictingScheduler"),
    _p("prefix_hit", f"{SCHEDULER}._get_local_prefix_cache_hit", "(self, request)", "overridden", "EvictingScheduler"),
    _p("preempt", f"{SCHEDULER}._preempt_request", "(self, request, timestamp, drop_stale_output=False)",
       "overridden", "EvictingScheduler"),
    _p("free_request", f"{SCHEDULER}._free_request", "(self, request, delay_free_blocks=False)", "overridden",
       "EvictingScheduler"),
    _p("waiting_remove", "vllm.v1.core.sched.request_queue:FCFSRequestQueue.remove_requests", "(self, requests)",
       "called", "EvictingScheduler._resumable_first"),
    _p("waiting_add", "vllm.v1.core.sched.request_queue:FCFSRequestQueue.add_request", "(self, request)", "called",
       "EvictingScheduler._resumable_first"),
    _p("create_blocks", "vllm.v1.core.kv_cache_manager:KVCacheManager.create_kv_cache_blocks", "(self, blocks)",
       "called", "EvictingScheduler._get_local_prefix_cache_hit"),
    _p("find_hit", "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.find_longest_cache_hit",
       "(self, block_hashes, max_cache_hit_length)", "called", "EvictingScheduler._get_local_prefix_cache_hit"),
    _p("blocks_to_allocate", f"{MANAGER}.get_num_blocks_to_allocate",
       "(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_local_computed_tokens, "
       "num_tokens_main_model, apply_admission_cap=False, prefill_end=0)", "overridden",
       "EvictingFullAttentionManager"),
    _p("allocate_blocks", f"{MANAGER}.allocate_new_blocks", "(self, request_id, num_tokens, num_tokens_main_model)",
       "overridden", "EvictingFullAttentionManager"),
    _p("cache_blocks", f"{MANAGER}.cache_blocks",
       "(self, request, num_tokens, retention_interval=None, *, replay_boundaries)", "overridden",
       "EvictingFullAttentionManager"),
    _p("free_blocks", f"{MANAGER}.pop_blocks_for_free", "(self, request_id)", "overridden",
       "EvictingFullAttentionManager"),
    _p("add_hit", f"{MANAGER}.add_local_computed_blocks",
       "(self, request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens)",
       "overridden", "EvictingFullAttentionManager"),
    _p("partial_hit", f"{MANAGER}._has_partial_local_hit", "(self, new_computed_blocks, num_local_computed_tokens)",
       "overridden", "EvictingFullAttentionManager"),
    _p("insert_hash", "vllm.v1.core.block_pool:BlockPool._insert_block_hash",
       "(self, block_hash_with_group_id, block, num_tokens)", "called",
       "EvictingFullAttentionManager.cache_checkpoint"),
    _p("removed_events", "vllm.v1.core.block_pool:BlockPool._emit_block_removed_events", "(self, block_hashes)",
       "wrapped", "patches._patch_removed_events"),
    _p("uncache_block", "vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block", "(self, block)", "called",
       "EvictingFullAttentionManager._stop_publishing"),
    _p("cached_block", "vllm.v1.core.block_pool:BlockHashToBlockMap.get_one_block", "(self, key)", "called",
       "EvictingFullAttentionManager.cached_block_id"),
    _p("free_queue_remove", "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.remove", "(self, block)", "called",
       "EvictingFullAttentionManager.evict_last"),
    _p("free_queue_append", "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.append", "(self, block)", "called",
       "EvictingFullAttentionManager.evict_last"),
    _p("block_hash", "vllm.v1.core.kv_cache_utils:make_block_hash_with_group_id", "(block_hash, group_id)", "called",
       "EvictingFullAttentionManager.cache_checkpoint"),
    # attention over head pages (kvserve/vllm/attention.py, kernel_attention.py, backend.py, model.py)
    _p("attention_init", f"{CPU_ATTENTION}:CPUAttentionBackendImpl.__init__",
       "(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, "
       "logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, sinks=None)",
       "overridden", "KVServeAttentionImpl, KVServeKernelAttentionImpl"),
    _p("attention_forward", f"{CPU_ATTENTION}:CPUAttentionBackendImpl.forward",
       "(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, "
       "output_block_scale=None)", "overridden", "KVServeAttentionImpl, KVServeKernelAttentionImpl"),
    _p("attention_write", f"{CPU_ATTENTION}:CPUAttentionBackendImpl.do_kv_cache_update",
       "(self, layer, key, value, kv_cache, slot_mapping)", "overridden",
       "KVServeAttentionImpl, KVServeKernelAttentionImpl"),
    _p("attention_metadata", f"{CPU_ATTENTION}:CPUAttentionMetadataBuilder.__init__",
       "(self, kv_cache_spec, layer_names, vllm_config, device)", "overridden", "KVServeAttentionMetadataBuilder"),
    _p("backend_impl", f"{CPU_ATTENTION}:CPUAttentionBackend.get_impl_cls", "()", "overridden",
       "KVServeAttentionBackend"),
    _p("backend_builder", f"{CPU_ATTENTION}:CPUAttentionBackend.get_builder_cls", "()", "overridden",
       "KVServeAttentionBackend"),
    _p("op_write", "vllm._custom_ops:cpu_attn_reshape_and_cache",
       "(key, value, key_cache, value_cache, slot_mapping, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype='auto')",
       "called", "KVServeAttentionImpl.do_kv_cache_update"),
    _p("op_attention", "vllm._custom_ops:cpu_attention_with_kv_cache",
       "(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, alibi_slopes, "
       "sliding_window, block_table, softcap, scheduler_metadata, s_aux, dynamic_causal=None, k_scale=1.0, "
       "v_scale=1.0, kv_cache_dtype='auto')", "called", "KVServeAttentionImpl.forward"),
    _p("op_metadata", "vllm._custom_ops:cpu_attn_get_scheduler_metadata",
       "(num_reqs, num_heads, num_kv_heads, head_dim, seq_lens, dtype, query_start_loc, causal, "
       "sliding_window_size, isa, enable_kv_split, dynamic_causal=None, kv_cache_dtype='auto')", "called",
       "KVServeAttentionImpl._metadata_builder"),
    _p("rope_table", "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbeddingBase._compute_cos_sin_cache",
       "(self)", "called", "model.rotary_tables"),
    _p("layer_number", "vllm.model_executor.models.utils:extract_layer_index", "(layer_name, num_attn_module=1)",
       "called", "model.layer_index"),
    _p("pipeline_group", "vllm.distributed.parallel_state:get_pp_group", "()", "called", "model.pipeline_group"),
    _p("tensor_group", "vllm.distributed.parallel_state:get_tp_group", "()", "called", "model.tensor_group"),
    # the API server: settings validated once, evicted counts to the response, headers, exit status
    # (kvserve/vllm/api_server.py)
    _p("input_validation", "vllm.v1.engine.input_processor:InputProcessor._validate_params",
       "(self, params, supported_tasks)", "wrapped", "api_server._patch_input_validation"),
    _p("generate", "vllm.v1.engine.async_llm:AsyncLLM.generate",
       "(self, prompt, sampling_params, request_id, *, prompt_text=None, lora_request=None, "
       "tokenization_kwargs=None, trace_headers=None, priority=0, data_parallel_rank=None, session_id=None, "
       "kv_hints=None, reasoning_ended=None, reasoning_parser_kwargs=None)", "wrapped",
       "api_server._patch_evicted_tally", "api"),
    _p("process_outputs", "vllm.v1.engine.output_processor:OutputProcessor.process_outputs",
       "(self, engine_core_outputs, engine_core_timestamp=None, iteration_stats=None, weight_version=None)",
       "wrapped", "api_server._patch_evicted_tally", "api"),
    _p("http_middleware", "vllm.entrypoints.launchers.app:init_entrypoints_middleware",
       "(args, app, supported_tasks)", "wrapped", "api_server._patch_middleware", "api"),
    _p("serve_http", "vllm.entrypoints.launchers.api_server.entry:serve_http",
       "(app, sock, enable_ssl_refresh=False, peer_loads=None, **uvicorn_kwargs)", "wrapped",
       "api_server._patch_exit_status", "api"),
    _p("shutdown", "vllm.v1.engine.async_llm:AsyncLLM.shutdown", "(self, timeout=None)", "wrapped",
       "api_server._patch_exit_status", "api"),
)  # fmt: skip

# the block pool's hashes that entered its cache without a BlockStored event (checkpoints'), planted by
# EvictingFullAttentionManager.cache_checkpoint and read by patches._patch_removed_events
UNANNOUNCED = "kvserve_unannounced_hashes"

# What kvserve reads or plants on vLLM's objects beyond their methods: (vLLM object, attribute, why).
ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("Attention (a layer)", "_k_scale_float, _v_scale_float",
     "read: the cache scales vLLM's own CPU attention passes to its ops"),
    ("Attention (a layer)", "_kvserve_layer_idx", "planted: the layer's model index, parsed once from its name"),
    ("Attention (a layer)", "layer_name, kv_cache",
     "read: a drafter's layers (a draft model's, named `draft_model.`; an EAGLE head's, numbered past the target's) "
     "stay vLLM's; each target layer's bound cache (model.py)"),
    ("Attention (a layer)", "_kvserve_drafter", "planted: whether the layer is a drafter's, once the worker attaches"),
    ("GPUModelRunner", "compilation_config.static_forward_context",
     "read: the attention layers by name, to find each target layer's cache beside a drafter's (model.py)"),
    ("UniformTypeKVCacheSpecs", "kv_cache_specs",
     "read: the target's page spec where a drafter of another cache shape shares its KV-cache group (model.py)"),
    ("ModelConfig", "_kvserve_support", "planted: which layers evict (`kvserve.model_support.eviction_support`)"),
    ("SchedulerOutput", "kvserve_plan", "planted: the engine core's StepPlan for the workers (carriers.py)"),
    ("ModelRunnerOutput", "kvserve_report", "planted: the workers' StepReport for the engine core (carriers.py)"),
    ("GPUModelRunner", "kvserve", "planted: the worker's WorkerRequests (worker.py)"),
    ("GPUModelRunner", "kvserve_generator_states", "planted: CPU generator states saved around sampling (patches.py)"),
    ("AsyncLLM", "kvserve_shutdown_requested", "planted: a shutdown someone asked for (api_server.py)"),
    ("Request", "skip_reading_prefix_cache", "set: an evicting request that reads no prefix-cache hit"),
    ("BlockPool", "enable_kv_cache_events", "read: whether events are published (kv_cache_manager.py)"),
    ("BlockPool", "kvserve_unannounced_hashes",
     "planted: checkpoint hashes cached without a BlockStored event, whose removal is not announced (patches.py)"),
    ("FullAttentionManager", "__class__", "swapped: the paged group's manager becomes EvictingFullAttentionManager"),
)  # fmt: skip


def signature_of(function: Callable) -> str:
    """A function's parameters as the table writes them: names, `*`, defaults (a default that is no plain value is
    `...`, an enum member `Type.NAME`); annotations are left out."""
    parts: list[str] = []
    keyword_only = False
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is parameter.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        if parameter.kind is parameter.VAR_POSITIONAL:
            keyword_only = True
            text = "*" + parameter.name
        elif parameter.kind is parameter.VAR_KEYWORD:
            text = "**" + parameter.name
        else:
            text = parameter.name
        if parameter.default is not parameter.empty:
            text += "=" + _default(parameter.default)
        parts.append(text)
    return "(" + ", ".join(parts) + ")"


def _default(value: object) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    return "..."


def resolve(target: str) -> Callable:
    module_name, _, qualified = target.partition(":")
    found = importlib.import_module(module_name)
    for part in qualified.split("."):
        found = getattr(found, part)
    return found


def check(points: Iterable[Point], version: str) -> None:
    """Each point's target exists in the installed vLLM with the parameters it was written against; otherwise a
    RuntimeError that names every point that moved and the version found."""
    moved = []
    for point in points:
        try:
            found = signature_of(resolve(point.target))
        except (ImportError, AttributeError) as error:
            moved.append(f"{point.name} ({point.target}): not found ({error})")
            continue
        if found != point.signature:
            moved.append(f"{point.name} ({point.target}): written for {point.signature}, vLLM {version} has {found}")
    if moved:
        raise RuntimeError(
            f"kvserve cannot run on vLLM {version}: {len(moved)} of the vLLM functions it patches, overrides or calls "
            "changed (kvserve/vllm/points.py):\n  " + "\n  ".join(moved)
        )


def group(name: str) -> tuple[Point, ...]:
    return tuple(point for point in POINTS if point.group == name)
