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

import functools
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from kvserve.config import KVConfig, parse_kv_config
from kvserve.errors import InvalidSetting
from kvserve.policies import POLICIES, KVzap
from kvserve.policies.knobs import KEY_PREFIX

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


@dataclass(frozen=True)
class ServedEngine:
    """What the settings checks need of the engine being served: vLLM's model config (read as `eviction_support`
    reads it), its block size, its pipeline stages and tensor-parallel ranks, and how many data-parallel engines the
    API server balances requests over (`engines`, the values of vLLM's X-data-parallel-rank header)."""

    model_config: Any
    block_size: int | None = None
    pipeline_stages: int = 1
    tensor_ranks: int = 1
    engines: int = 1


# The answer `served_settings(..., remember=True)` gave in this context: the HTTP middleware runs in the context every
# later step of the request's handling inherits, vLLM's input validation among them (a new request, a new context).
_remembered: ContextVar[tuple[tuple, KVConfig] | None] = ContextVar("kvserve_served_settings", default=None)


def served_settings(
    request_args: dict[str, Any] | None, engine: ServedEngine | None, remember: bool = False
) -> KVConfig:
    """The settings a request is served with: its `kv_*` keys over the server's defaults (`parse_kv_config`),
    checked against the served model (`check_against_model`; without an engine known, only the settings themselves);
    an `InvalidSetting` names the field. The HTTP middleware asks first, with `remember`, so that a stream gets its 400
    before it starts; vLLM's input validation asks again for the same request and gets that answer: a request's
    settings are parsed once."""
    asked = {key: value for key, value in (request_args or {}).items() if key.startswith(KEY_PREFIX)}
    key = tuple(sorted((name, repr(value)) for name, value in asked.items()))
    remembered = _remembered.get()
    if remembered is not None and remembered[0] == key:
        return remembered[1]
    config = parse_kv_config(asked)
    if engine is not None:
        config = check_against_model(
            config,
            engine.model_config,
            asked,
            block_size=engine.block_size,
            pipeline_stages=engine.pipeline_stages,
            tensor_ranks=engine.tensor_ranks,
        )
    if remember and engine is not None:  # (without an engine, not the whole answer)
        _remembered.set((key, config))
    return config


@functools.lru_cache(maxsize=4)
def model_tokenizer(tokenizer: str, trust_remote_code: bool = False):
    """The served model's tokenizer (transformers'), loaded once per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)


@functools.lru_cache(maxsize=8)
def generation_marker(tokenizer: str, trust_remote_code: bool = False) -> tuple[int, ...] | None:
    """The tokens the model's chat template appends to ask for a reply (`<|im_start|>assistant\n`): every chat
    prompt ends with them, and a later turn's prompt holds them where the earlier turn's prompt ended. None: the
    model has no chat template, or its template does not append one fixed sequence."""
    loaded = model_tokenizer(tokenizer, trust_remote_code)
    if not getattr(loaded, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "x"}]

    def ids(generation_prompt: bool) -> list[int]:
        encoded = loaded.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    asking, plain = ids(True), ids(False)
    if len(asking) <= len(plain) or asking[: len(plain)] != plain:
        return None
    return tuple(asking[len(plain) :])


def check_against_model(
    config: KVConfig,
    model_config,
    request_args: dict[str, Any] | None,
    block_size: int | None = None,
    pipeline_stages: int = 1,
    tensor_ranks: int = 1,
) -> KVConfig:
    """The checks that need the served model (vLLM's `ModelConfig`): a model that cannot evict, a budget no sequence
    can reach, a gate the model does not have. Returns the configuration to serve: on a model that cannot evict
    (`kvserve/model_support.py`) the server's default eviction does not apply, and a request whose own `kv_*` keys
    (`request_args`) ask for eviction is an error naming the reason.

    Run by the HTTP middleware (so a streamed request gets a 400, not an error event after its 200) and by vLLM's
    input validation (offline use); both pass the engine's `block_size`, pipeline stages and tensor-parallel ranks."""
    model, max_model_len = model_config.model, model_config.max_model_len
    support = eviction_support(model_config)
    if config.evicts and not support.evicts:
        asked = sorted(key for key in (request_args or {}) if key.startswith(KEY_PREFIX))
        if asked:
            field = "kv_policy" if "kv_policy" in asked else asked[0]
            raise InvalidSetting(field, f"asks for eviction, which this model lacks: {support.reason}")
        return KVConfig()
    if config.evicts and config.budget is not None and config.budget > max_model_len:
        # a budget no sequence can reach is a mistake, not a way to turn eviction off (policy full does that)
        raise InvalidSetting("kv_budget", f"{config.budget} is above max_model_len ({max_model_len})")
    if config.evicts and tensor_ranks > 1:
        _check_tensor_parallel(config, tensor_ranks)
    if config.evicts and POLICIES[config.policy].reconstructs and not config.document:
        raise InvalidSetting(
            "kv_document",
            f"{config.policy} scores a document by the model's reconstruction of it: compress the document with POST "
            "/v1/kvserve/compress and send its kv_document with each request that starts with it",
        )
    if config.checkpoints and support.hybrid:
        raise InvalidSetting(
            _checkpoint_field(config), f"is not served on {model}: its sliding-window layers keep blocks of their own"
        )
    if config.checkpoints:
        _check_checkpoint(config, block_size, pipeline_stages)
    if config.checkpoint_turns:
        if generation_marker(model_config.tokenizer, model_config.trust_remote_code) is None:
            raise InvalidSetting(
                "kv_checkpoint",
                f"turns needs a chat template that ends each prompt with one token sequence; {model} has none",
            )
    if config.policy == "attention_gate":
        from kvserve.gates.registry import NoGateError, gate_entry

        try:
            gate_entry(model)
        except NoGateError as exc:
            raise InvalidSetting("kv_policy", str(exc)) from exc
    if config.evicts and POLICIES[config.policy].own_counts:  # DuoAttention: the model's trained head roles
        from kvserve.duo.roles import roles_for

        try:
            roles_for(model, model_config.get_total_num_kv_heads())
        except ValueError as exc:
            raise InvalidSetting("kv_policy", str(exc)) from exc
    if config.evicts and issubclass(POLICIES[config.policy], KVzap):  # its surrogate, trained for this very model
        from kvserve.kvzap.registry import NoSurrogateError, checked_surrogates

        try:
            checked_surrogates(str(model))
        except NoSurrogateError as exc:
            raise InvalidSetting("kv_policy", str(exc)) from exc
    return config


def _check_tensor_parallel(config: KVConfig, tensor_ranks: int) -> None:
    """Under tensor parallelism each rank holds and scores only its own KV heads (and their query heads): settings
    that need every head at once are refused rather than served differently from one rank."""
    if config.allocation in ("heads", "global"):
        default_allocation = POLICIES[config.policy].default_allocation
        raise InvalidSetting(
            "kv_allocation",
            f"{config.allocation} ranks entries across all KV heads; under tensor parallelism ({tensor_ranks} ranks) "
            "each rank holds only its own heads. Use uniform (spans work)"
            + (
                f"; {config.allocation} is {config.policy}'s default" if default_allocation == config.allocation else ""
            ),
        )
    if config.policy == "attention_gate":
        raise InvalidSetting(
            "kv_policy",
            f"attention_gate's gates read every query head of a layer; under tensor parallelism ({tensor_ranks} "
            "ranks) each rank computes only its own",
        )
    if issubclass(POLICIES[config.policy], KVzap):
        raise InvalidSetting(
            "kv_policy",
            f"kvzap's surrogate reads every query head of a token; under tensor parallelism ({tensor_ranks} ranks) "
            "each rank computes only its own",
        )
    if dict(config.knobs).get("vote_scope") == "layer":
        raise InvalidSetting(
            "kv_vote_scope",
            f"layer averages the votes of every query head of a layer; under tensor parallelism ({tensor_ranks} "
            "ranks) each rank computes only its own: use group",
        )


def _checkpoint_field(config: KVConfig) -> str:
    return "kv_document" if config.document else "kv_checkpoint"


def _check_checkpoint(config: KVConfig, block_size: int | None, pipeline_stages: int) -> None:
    """kv_checkpoint's and kv_document's engine checks: checkpoints are published as whole vLLM blocks, one
    worker's."""
    field = _checkpoint_field(config)
    if pipeline_stages > 1:
        raise InvalidSetting(
            field, "is not served with pipeline parallelism (each stage would publish its own layers' pages)"
        )
    if block_size is None:
        return
    if config.checkpoint % block_size:  # (0 with turns)
        raise InvalidSetting(
            "kv_checkpoint", f"must be a multiple of the block size ({block_size}), got {config.checkpoint}"
        )
    if config.budget % block_size:
        raise InvalidSetting(
            field,
            f"needs kv_budget to be a multiple of the block size ({block_size}) so that a checkpoint's lists fill "
            f"whole blocks; kv_budget is {config.budget}",
        )
