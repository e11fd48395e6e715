"""Which layers of a model kvserve evicts on, read from its config the same way in every vLLM process.

The API server needs the answer before any request reaches the engine (a request that asks a model for eviction it
cannot do gets a 400 naming the reason); the scheduler and the worker need it to pick the KV-cache group whose blocks
become head pages. All three hold the model's config, so all three read it here, and the engine then checks the
answer against the cache groups vLLM really built (`paged_group`).

- Full attention in every layer (Llama, Qwen2/3, Phi-3, ...): every layer evicts.
- Hybrid local/global models (Gemma 2/3, Cohere2, ...): vLLM keeps the sliding-window layers in groups of their own,
  already bounded by their window; kvserve evicts on the full-attention layers, where a long request's memory goes.
- Anything else (every layer windowed, chunked local attention, learned attention sinks, latent attention, cross-
  attention, recurrent layers): served exactly as vanilla vLLM serves it, with eviction unavailable and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class EvictionSupport:
    num_layers: int  # attention layers of the whole model
    paged_layers: tuple[int, ...]  # the model layers whose caches evict (head pages); empty: none
    reason: str | None = None  # why this model cannot evict (None: it can)
    window: int | None = None  # the sliding window of the other layers, if any

    @property
    def evicts(self) -> bool:
        return self.reason is None

    @property
    def hybrid(self) -> bool:
        return self.evicts and len(self.paged_layers) < self.num_layers

    def describe(self) -> str:
        """One line for the start-up log and the README's model matrix."""
        if not self.evicts:
            return f"eviction unavailable: {self.reason}; served as vanilla vLLM serves it"
        if not self.hybrid:
            return f"evicts on all {self.num_layers} layers"
        windowed = self.num_layers - len(self.paged_layers)
        return (
            f"evicts on its {len(self.paged_layers)} full-attention layers {list(self.paged_layers)}; its {windowed} "
            f"sliding-window layers keep vLLM's {self.window}-token window"
        )


def eviction_support(model_config) -> EvictionSupport:
    """What kvserve can evict on for vLLM's `ModelConfig` (cached on it: the front end asks once per request)."""
    cached = getattr(model_config, "_kvserve_support", None)
    if cached is None:
        cached = _support(model_config)
        try:
            model_config._kvserve_support = cached
        except AttributeError:  # a frozen stand-in: just compute it again next time
            pass
    return cached


def _support(model_config) -> EvictionSupport:
    text = model_config.hf_text_config
    num_layers = model_config.get_total_num_hidden_layers()
    window = getattr(text, "sliding_window", None)

    def unavailable(reason: str) -> EvictionSupport:
        return EvictionSupport(num_layers, (), reason, window)

    if model_config.is_attention_free or model_config.is_hybrid:
        return unavailable("the model has recurrent (state-space or linear-attention) layers, not a KV cache per token")
    if model_config.use_mla:
        return unavailable("multi-head latent attention caches one latent per token, not one entry per KV head")
    if model_config.is_encoder_decoder:
        return unavailable("encoder-decoder models cache cross-attention, which kvserve does not evict")
    if getattr(text, "attention_chunk_size", None):
        return unavailable("chunked local attention layers (kvserve's head pages do not model chunk boundaries)")
    if getattr(text, "model_type", None) == "gpt_oss" or getattr(text, "attention_sinks", None):
        return unavailable("learned attention sinks (a per-head logit kvserve's attention call does not carry)")
    if getattr(text, "num_kv_shared_layers", 0):
        return unavailable("layers that share another layer's KV cache")
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        others = sorted({kind for kind in layer_types if kind not in (FULL_ATTENTION, SLIDING_ATTENTION)})
        if others:
            return unavailable(f"layers of kind {', '.join(others)}")
        paged = tuple(index for index, kind in enumerate(layer_types) if kind == FULL_ATTENTION)
    elif window is not None and getattr(text, "use_sliding_window", True):
        paged = ()
    else:
        paged = tuple(range(num_layers))
    if not paged:
        return unavailable(
            f"every layer attends within a sliding window of {window} tokens, which already bounds its cache"
        )
    return EvictionSupport(num_layers, paged, None, window if len(paged) < num_layers else None)


def paged_group(kv_cache_config, support: EvictionSupport) -> int | None:
    """The KV-cache group kvserve pages: the one full-attention group, holding (this stage's share of) exactly the
    layers `support` evicts on. None when the model cannot evict; a RuntimeError when vLLM built other groups than
    the config predicts (a model kind this module reads wrongly must fail loudly, not evict the wrong layers)."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if not support.evicts:
        return None
    groups = kv_cache_config.kv_cache_groups
    full = [index for index, group in enumerate(groups) if type(group.kv_cache_spec) is FullAttentionSpec]
    kinds = [type(group.kv_cache_spec).__name__ for group in groups]
    if len(full) == 1:
        layers = {extract_layer_index(name) for name in groups[full[0]].layer_names}
        if layers <= set(support.paged_layers):
            return full[0]
    raise RuntimeError(
        f"kvserve read this model as one that {support.describe()}, but vLLM built KV-cache groups {kinds}; "
        "run vanilla vLLM (VLLM_PLUGINS without 'kvserve') and report the model"
    )
