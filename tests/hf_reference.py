"""Independent references in plain transformers/PyTorch: the same model, the same keep rules, no vLLM.

Written from the papers' rules, not by calling kvserve, so that agreement with the engine means something.
"""

from __future__ import annotations

from contextlib import contextmanager

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
    return _decode(model, cache, out, len(prompt_ids), max_tokens, after_decode_step)


def _decode(model, cache, out, position: int, max_tokens: int, after_decode_step=lambda cache: None) -> list[int]:
    """Greedy tokens from `out`'s last logits on, each fed back at the next logical position."""
    generated = [int(out.logits[0, -1].argmax())]
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


@torch.no_grad()
def expected_attention_reference(model, prompt_ids: list[int], budget: int, window: int, future: int, sinks: int):
    """Expected Attention's choice per layer (arXiv:2510.00636) computed the way its authors' kvpress does (plus
    the window kept, as kvserve serves it: kvpress keeps the question out of compression), from the model's own
    modules: the queries' mean and covariance from the hidden states entering each attention layer times W_q (before
    RoPE), RoPE's matrix from the model's rotary embedding averaged over the next `future` positions, keys and values
    from the model's cache.

    Returns (keep [L][H, B] sorted positions, scores [L][H, n]).
    """
    entering: dict[int, torch.Tensor] = {}

    def capture(index):
        def hook(module, args, kwargs):
            entering[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    layers = model.model.layers
    hooks = [layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    n, config = len(prompt_ids), model.config
    num_q, num_kv = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // num_q
    future_positions = torch.arange(n, n + future)[None]
    cos, sin = model.model.rotary_emb(entering[0], future_positions)  # [1, F, D] each, halves repeated
    half = dim // 2
    rotate_half = torch.zeros(dim, dim)  # P with P x = rotate_half(x) = [-x2, x1]
    rotate_half[:half, half:], rotate_half[half:, :half] = -torch.eye(half), torch.eye(half)
    mean_rotation = torch.diag(cos[0].mean(dim=0)) + torch.diag(sin[0].mean(dim=0)) @ rotate_half
    keeps, all_scores = [], []
    for index, layer in enumerate(layers):
        hidden = entering[index][0, n - window :]  # the window's hidden states (past the sinks when n is long)
        hidden = hidden[max(0, sinks - (n - window)) :]
        queries = (hidden @ layer.self_attn.q_proj.weight.T).view(-1, num_q, dim)  # [w, Hq, D], before RoPE
        mu = queries.mean(dim=0)
        centred = queries - mu
        sigma = torch.einsum("wqd,wqe->qde", centred, centred) / queries.shape[0]
        mu, sigma = mu @ mean_rotation.T, mean_rotation @ sigma @ mean_rotation.T
        keys = out.past_key_values.layers[index].keys[0]  # [H, n, D] after RoPE
        values = out.past_key_values.layers[index].values[0]
        group_keys = keys.repeat_interleave(num_q // num_kv, dim=0)  # [Hq, n, D]
        scale = dim**-0.5
        logits = scale * torch.einsum("qd,qnd->qn", mu, group_keys)
        logits += scale**2 * torch.einsum("qnd,qde,qne->qn", group_keys, sigma, group_keys) / 2
        logits[:, :sinks] = float("-inf")
        probs = torch.softmax(logits, dim=-1).view(num_kv, -1, n).mean(dim=1)
        scores = probs * values.norm(dim=-1)
        # the sinks and the window's own tokens (the prompt's tail: the question) are kept; the rest by score
        middle = scores[:, sinks : n - window]
        ranked = torch.sort(middle, dim=-1, descending=True, stable=True).indices[:, : budget - sinks - window] + sinks
        sink_idx = torch.arange(sinks).expand(num_kv, -1)
        window_idx = torch.arange(n - window, n).expand(num_kv, -1)
        keeps.append(torch.sort(torch.cat([sink_idx, ranked, window_idx], dim=1), dim=1).values)
        all_scores.append(scores)
    return keeps, all_scores


@contextmanager
def fp8_cache(fmt: torch.dtype, key_scale: float = 1.0, value_scale: float = 1.0):
    """The model attends over keys and values as an fp8 KV cache holds them: every attention layer of a Llama model
    reads each key and value rounded toward zero to an fp8 value of `fmt` (times its scale), as vLLM's CPU cache
    writer stores them and its attention reads them back. Queries stay unquantised."""
    from cache_writers import fp8_reference
    from transformers.models.llama import modeling_llama

    original = modeling_llama.eager_attention_forward

    def quantised(module, query, key, value, *args, **kwargs):
        key = fp8_reference(key, fmt, key_scale)[1].to(key.dtype)
        value = fp8_reference(value, fmt, value_scale)[1].to(value.dtype)
        return original(module, query, key, value, *args, **kwargs)

    modeling_llama.eager_attention_forward = quantised
    try:
        yield
    finally:
        modeling_llama.eager_attention_forward = original


@torch.no_grad()
def kvzip_reference(model, document: list[int], instruction: list[int], budget: int, sinks: int):
    """KVzip's choice (arXiv:2505.23416): the document, the instruction and the document again through the model;
    each document entry scores the most attention any query after the document, in any query head of its KV group,
    gave it; the first `sinks` and the top scores are kept. Returns (keep [L][H, B], scores [L][H, len(document)])."""
    return kvzip_pieces_reference(model, document, [instruction + document], budget, sinks)


@torch.no_grad()
def kvzip_pieces_reference(model, document: list[int], suffixes: list[list[int]], budget: int, sinks: int):
    """KVzip reconstructed piece by piece: the document then each suffix (an instruction and a piece of the copy)
    through the model, one run per piece; each document entry scores the most attention any query after the
    document, in any run and any query head of its KV group, gave it. Returns (keep [L][H, B], scores [L][H, n])."""
    num_kv, n = model.config.num_key_value_heads, len(document)
    peaks = None
    for suffix in suffixes:
        out = model(input_ids=torch.tensor([document + suffix]), output_attentions=True)
        layers = []
        for attn in out.attentions:  # [1, Hq, q, k]
            reconstruction = attn[0, :, n:, :n]  # queries past the document, keys of the document
            layers.append(reconstruction.reshape(num_kv, -1, reconstruction.shape[1], n).amax(dim=(1, 2)))
        peaks = layers if peaks is None else [torch.maximum(a, b) for a, b in zip(peaks, layers, strict=True)]
    keeps, scores = [], []
    for peak in peaks:  # [H, n]
        ranked = peak.masked_fill(torch.arange(n) < sinks, float("inf"))
        top = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :budget]
        keeps.append(torch.sort(top, dim=-1).values)
        scores.append(peak)
    return keeps, scores


@torch.no_grad()
def generate_after_kept_prefix(model, prefix: list[int], kept, suffix: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding of `suffix` after a prefix of which each layer and KV head holds only the `kept` [L][H, B]
    positions: the suffix's queries see the kept entries and themselves, at their own logical positions."""
    cache = model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
    _keep_in_cache(cache, kept)
    start = len(prefix)
    out = model(
        input_ids=torch.tensor([suffix]),
        position_ids=torch.arange(start, start + len(suffix))[None],
        past_key_values=cache,
        use_cache=True,
    )
    return _decode(model, cache, out, start + len(suffix), max_tokens)
