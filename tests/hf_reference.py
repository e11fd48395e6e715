"""Independent references in plain transformers/PyTorch: the same model, the same keep rules, no vLLM.

Written from the papers' rules, not by calling kvserve, so that agreement with the engine means something.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def load_hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _keep_in_cache(cache, per_layer_keep) -> None:
    for layer, keep in zip(cache.layers, per_layer_keep, strict=True):
        # keep: [H, B] indices per KV head
        idx = keep[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
        layer.keys = layer.keys.gather(2, idx)
        layer.values = layer.values.gather(2, idx)


def _sink_recent(length: int, budget: int, sinks: int, num_heads: int) -> torch.Tensor:
    keep = list(range(sinks)) + list(range(length - (budget - sinks), length))
    return torch.tensor(keep).expand(num_heads, -1)


def _greedy(model, prompt_ids: list[int], max_tokens: int, after_prefill, after_decode_step) -> list[int]:
    """Greedy decoding with logical RoPE positions; the callbacks may shrink the cache (after the step's logits)."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    cache = out.past_key_values
    after_prefill(cache)
    generated = [int(out.logits[0, -1].argmax())]
    position = len(prompt_ids)
    while len(generated) < max_tokens:
        out = model(
            input_ids=torch.tensor([[generated[-1]]]),
            position_ids=torch.tensor([[position]]),
            past_key_values=cache,
            use_cache=True,
        )
        position += 1
        after_decode_step(cache)
        generated.append(int(out.logits[0, -1].argmax()))
    return generated


@torch.no_grad()
def streamingllm_generate(
    model, prompt_ids: list[int], max_tokens: int, budget: int, sinks: int, block_size: int
) -> list[int]:
    """Greedy decoding with StreamingLLM applied when kvserve applies it: after the prompt (if it exceeds the
    budget), then whenever the cache reaches budget + block_size after a decode step. RoPE positions stay logical."""
    num_layers = model.config.num_hidden_layers
    num_heads = model.config.num_key_value_heads

    def evict_if(cache, threshold: int) -> None:
        length = cache.layers[0].keys.shape[2]
        if length >= threshold:
            _keep_in_cache(cache, [_sink_recent(length, budget, sinks, num_heads)] * num_layers)

    return _greedy(
        model,
        prompt_ids,
        max_tokens,
        lambda cache: evict_if(cache, budget + 1),
        lambda cache: evict_if(cache, budget + block_size),
    )


@torch.no_grad()
def snapkv_reference(model, prompt_ids: list[int], budget: int, window: int, kernel_size: int):
    """SnapKV's choice per layer from the model's own attention probabilities on the whole prompt.

    Returns (keep [L][H, B] sorted positions, pooled scores [L][H, n - window]).
    """
    out = model(input_ids=torch.tensor([prompt_ids]), output_attentions=True)
    num_kv = model.config.num_key_value_heads
    keeps, scores = [], []
    n = len(prompt_ids)
    for attn in out.attentions:  # [1, Hq, n, n]
        votes = attn[0, :, n - window :, :].sum(dim=1)  # [Hq, n]: each key's attention from the window
        votes = votes.reshape(num_kv, -1, n).sum(dim=1)  # sum the query heads of each KV group
        pooled = F.avg_pool1d(votes[:, None, : n - window], kernel_size, stride=1, padding=kernel_size // 2)[:, 0]
        top = torch.sort(pooled, dim=-1, descending=True, stable=True).indices[:, : budget - window]
        window_idx = torch.arange(n - window, n).expand(num_kv, -1)
        keeps.append(torch.sort(torch.cat([top, window_idx], dim=1), dim=1).values)
        scores.append(pooled)
    return keeps, scores


@torch.no_grad()
def generate_with_kept(model, prompt_ids: list[int], max_tokens: int, per_layer_keep) -> list[int]:
    """Greedy decoding after keeping the given cache positions per layer and head (no later eviction)."""
    return _greedy(
        model, prompt_ids, max_tokens, lambda cache: _keep_in_cache(cache, per_layer_keep), lambda cache: None
    )


@torch.no_grad()
def attention_probabilities(model, prompt_ids: list[int]) -> list[torch.Tensor]:
    """Per layer, the model's own eager attention probabilities summed over each KV group's query heads:
    [H_kv, n queries, n keys]."""
    out = model(input_ids=torch.tensor([prompt_ids]), output_attentions=True)
    num_kv = model.config.num_key_value_heads
    n = len(prompt_ids)
    return [attn[0].reshape(num_kv, -1, n, n).sum(dim=1) for attn in out.attentions]


def top_keep(scores: torch.Tensor, budget: int, protected: int) -> torch.Tensor:
    """Sorted positions: the last `protected` always, then the highest scores (ties: the earlier position)."""
    n = scores.shape[-1]
    candidates = scores[:, : n - protected]
    top = torch.sort(candidates, dim=-1, descending=True, stable=True).indices[:, : budget - protected]
    recent = torch.arange(n - protected, n).expand(scores.shape[0], -1)
    return torch.sort(torch.cat([top, recent], dim=1), dim=1).values
