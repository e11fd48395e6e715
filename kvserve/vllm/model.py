"""How kvserve reads vLLM's model and engine: which KV-cache group holds head pages, each paged attention layer's
index, cache and RoPE table, whether a layer's features fit head pages, the engine facts the settings checks need,
and the pipeline group."""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

from kvserve.model_support import EvictionSupport, ServedEngine, eviction_support
from kvserve.policies.rotary import Rotary
from kvserve.worker.pages import PageLayout

# A drafter with layers of its own joins the target's KV-cache group (the same blocks, the same block table); kvserve
# pages only the target's layers. vLLM's DraftModelProposer loads a draft model under this prefix (its layers keep
# their own numbers); an EAGLE or EAGLE-3 head's layers are numbered on from the target's last
# (`EagleLlamaForCausalLM`, `Eagle3LlamaForCausalLM`).
DRAFTER_PREFIX = "draft_model."


def is_drafter_name(name: str, num_layers: int) -> bool:
    """Whether a named attention layer is a drafter's, not one of the target model's `num_layers` layers."""
    return name.startswith(DRAFTER_PREFIX) or extract_layer_index(name) >= num_layers


def model_layer_names(layer_names, num_layers: int) -> list[str]:
    """The target model's attention layers among `layer_names` (a drafter's are not the model's)."""
    return [name for name in layer_names if not is_drafter_name(name, num_layers)]


def mark_drafter_layers(runner, num_layers: int) -> None:
    """Plant on each attention layer whether it is a drafter's, read on every step by `is_drafter_layer`."""
    for name, layer in runner.compilation_config.static_forward_context.items():
        if hasattr(layer, "layer_name"):
            layer._kvserve_drafter = is_drafter_name(name, num_layers)


def is_drafter_layer(layer) -> bool:
    """Whether an attention layer is a drafter's: its cache stays vLLM's, addressed by vLLM's block table (planted
    when the worker attaches: `mark_drafter_layers`)."""
    return layer._kvserve_drafter


def paged_spec(group, num_layers: int) -> FullAttentionSpec | None:
    """The target model's page spec in a KV-cache group: the group's own spec, or, where vLLM put a draft model of
    another cache shape (KV heads, head size, dtype) beside the target in one group of mixed shapes (one block table,
    a cache per layer in its own page size), the one spec every target layer shares. None when the target's layers
    are not all full attention of one shape."""
    spec = group.kv_cache_spec
    if type(spec) is not UniformTypeKVCacheSpecs:
        return spec if type(spec) is FullAttentionSpec else None
    shapes = {spec.kv_cache_specs[name] for name in model_layer_names(group.layer_names, num_layers)}
    target = shapes.pop() if len(shapes) == 1 else None
    return target if type(target) is FullAttentionSpec else None


def paged_group(kv_cache_config, support: EvictionSupport) -> int | None:
    """The KV-cache group kvserve pages: the one full-attention group (a draft model's layers of another shape beside
    the target's in it), holding (this stage's share of) exactly the layers `support` evicts on. None when the model
    cannot evict; a RuntimeError when vLLM built other groups than the config predicts (a model kind this module
    reads wrongly must fail loudly, not evict the wrong layers)."""
    if not support.evicts:
        return None
    groups = kv_cache_config.kv_cache_groups
    full = [index for index, group in enumerate(groups) if paged_spec(group, support.num_layers) is not None]
    kinds = [type(group.kv_cache_spec).__name__ for group in groups]
    if len(full) == 1:
        names = model_layer_names(groups[full[0]].layer_names, support.num_layers)
        layers = {extract_layer_index(name) for name in names}
        if layers <= set(support.paged_layers):
            return full[0]
    raise RuntimeError(
        f"kvserve read this model as one that {support.describe()}, but vLLM built KV-cache groups {kinds}; "
        "run vanilla vLLM (VLLM_PLUGINS without 'kvserve') and report the model"
    )


def served_engine(vllm_config) -> ServedEngine | None:
    """What the settings checks need of the engine vLLM's VllmConfig describes (None: no engine known yet)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    return ServedEngine(
        model_config,
        block_size=vllm_config.cache_config.block_size,
        pipeline_stages=vllm_config.parallel_config.pipeline_parallel_size,
        tensor_ranks=vllm_config.parallel_config.tensor_parallel_size,
        engines=balanced_engines(vllm_config.parallel_config),
    )


def balanced_engines(parallel) -> int:
    """The engines this API server's balancer chooses among: every data-parallel engine with vLLM's internal
    balancer, this node's with the hybrid one, only its own with an external one."""
    if parallel.data_parallel_external_lb:
        return 1
    return parallel.data_parallel_size_local if parallel.data_parallel_hybrid_lb else parallel.data_parallel_size


def served_engine_of_app(scope: dict) -> ServedEngine | None:
    """The served engine of an HTTP request's app: vLLM puts its VllmConfig on the app's state before serving."""
    app = scope.get("app")
    return served_engine(getattr(getattr(app, "state", None), "vllm_config", None))


def layer_index(layer, layout: PageLayout) -> int:
    """The position of an attention layer's cache in this worker's page view, from its model layer (parsed from its
    name once and kept on it): a later pipeline stage starts past 0, a hybrid model pages only some layers."""
    index = getattr(layer, "_kvserve_layer_idx", None)
    if index is None:
        index = layer._kvserve_layer_idx = extract_layer_index(layer.layer_name)
    return layout.local_index(index)


def pages_this_layer(impl, mode: str) -> bool:
    """Whether this attention layer's cache is head pages (read and written by kvserve) or stays vLLM's (a model
    that does not evict; a hybrid model's sliding-window layer). Read at model construction, where vLLM's config of
    the engine being built is current. (The cache layout and dtype are the metadata builder's to check:
    `kvserve/vllm/backend.py`.)"""
    support = eviction_support(get_current_vllm_config().model_config)
    if not support.evicts or impl.sliding_window != -1:
        return False
    # features whose per-query-head or per-sequence parameters the pseudo-sequence call cannot carry
    unsupported = {
        "attention type other than decoder": impl.attn_type != AttentionType.DECODER,
        "ALiBi": impl.alibi_slopes is not None,
        "attention sinks": impl.sinks is not None,
        "KV sharing between layers": impl.kv_sharing_target_layer_name is not None,
    }
    refused = [name for name, present in unsupported.items() if present]
    if refused:  # the config reading said this model evicts: it is wrong about this model, so fail loudly
        raise RuntimeError(
            f"kvserve's head pages ({mode}) do not support {', '.join(refused)}, which this model uses although "
            f"kvserve read its config as one that {support.describe()}; run vanilla vLLM (VLLM_PLUGINS without "
            "'kvserve') and report the model"
        )
    return True


def layer_numbers(layer_names, num_layers: int) -> tuple[int, ...]:
    """The model layer of each of the target model's named attention layers, in order."""
    return tuple(sorted(extract_layer_index(name) for name in model_layer_names(layer_names, num_layers)))


def caches_by_layer(runner, num_layers: int) -> dict[int, torch.Tensor]:
    """This worker's KV caches of the target model's layers, by model layer. vLLM lists `runner.kv_caches` in layer
    order over every group, a draft model's layers beside the target's under the same numbers, so each layer's cache
    is found as the one its attention module was bound to (a view of it, at the same address)."""
    context = runner.compilation_config.static_forward_context
    by_address = {cache.data_ptr(): cache for cache in runner.kv_caches}
    groups = runner.kv_cache_config.kv_cache_groups
    names = model_layer_names((name for group in groups for name in group.layer_names), num_layers)
    caches = {extract_layer_index(name): by_address.get(context[name].kv_cache.data_ptr()) for name in names}
    unbound = [index for index, cache in caches.items() if cache is None]
    if unbound or len(caches) != len(names):
        raise RuntimeError(f"kvserve: no KV cache of its own for attention layers {unbound or sorted(caches)}")
    return caches


def rotary_tables(model: torch.nn.Module, model_layers: tuple[int, ...], device: torch.device) -> dict[int, Rotary]:
    """The RoPE table of each paged layer (by page-view index), read from the model's own rotary modules, so that a
    scaled variant (YaRN, Llama 3, ...) arrives as the model applies it. A layer's module is the one named inside it
    (`model.layers.5.self_attn.rotary_emb`); a model with one rotary module outside its layers shares it. A layer
    with neither gets none (a policy that needs it then fails with the reason)."""
    by_layer: dict[int, RotaryEmbeddingBase] = {}
    shared: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):  # get_rope hands one module to many layers
        if isinstance(module, RotaryEmbeddingBase):
            shared.add(id(module))
            try:
                by_layer.setdefault(extract_layer_index(name), module)
            except AssertionError:  # no layer number in the name: a model-level module
                by_layer.setdefault(-1, module)
    tables = {}
    for index, model_layer in enumerate(model_layers):
        module = by_layer.get(model_layer, by_layer.get(-1) if len(shared) == 1 else None)
        if module is None:
            continue
        try:  # vLLM's float32 table, before it is cast to the model's dtype
            table = module._compute_cos_sin_cache()
        except TypeError:  # a variant whose table takes arguments: the one the model holds
            table = module.cos_sin_cache
        cos, sin = table.float().to(device).chunk(2, dim=-1)
        tables[index] = Rotary(cos.contiguous(), sin.contiguous(), neox=bool(module.is_neox_style))
    return tables


def pipeline_group():
    """vLLM's pipeline-parallel group coordinator, or None without pipeline parallelism."""
    group = get_pp_group()
    return group if group.world_size > 1 else None


def tensor_group():
    """vLLM's tensor-parallel group coordinator, or None without tensor parallelism."""
    group = get_tp_group()
    return group if group.world_size > 1 else None
