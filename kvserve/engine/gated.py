"""One layer's step for a request under a ragged policy (Attention-Gate): gate the prompt chunk, attend with the
per-head keep mask, and compact each head's kept entries to the front of the request's blocks.

vLLM's kernel attends to every cached entry, so for these requests the layer's output rows are recomputed here with
the mask of seed 000 (Eq. 4/7): a query sees an entry if it is its own token, or an earlier token that is valid for
that KV head. Invalid entries are prompt tokens the gate flagged out (hidden at once, physically dropped at the next
compaction) and the padding a shorter head carries up to the request's common length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.engine.cache_layout import PagedKV, compact_entries, read_entries
from kvserve.metrics import metrics

QUERY_CHUNK = 256  # queries per masked-attention slice: bounds the [H, G, q, n] temporary in a long prefill


def masked_attention(queries: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, key_positions: torch.Tensor, valid: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """queries [m, Hq, D] at positions [m]; entries [H, n, D] at key_positions [H, n], valid [H, n] -> [m, Hq, D]."""
    num_heads, _, dim = keys.shape
    out = []
    for start in range(0, queries.shape[0], QUERY_CHUNK):
        q = queries[start : start + QUERY_CHUNK].float()
        q_pos = query_positions[start : start + QUERY_CHUNK]
        grouped = q.reshape(q.shape[0], num_heads, -1, dim).permute(1, 2, 0, 3)  # [H, G, q, D]
        logits = torch.einsum("hgqd,hnd->hgqn", grouped, keys.float()) * scale
        own = key_positions[:, None, :] == q_pos[None, :, None]  # [H, q, n]
        earlier = (key_positions[:, None, :] < q_pos[None, :, None]) & valid[:, None, :]
        logits = logits.masked_fill(~(own | earlier)[:, None], float("-inf"))
        mixed = torch.einsum("hgqn,hnd->hgqd", torch.softmax(logits, dim=-1), values.float())
        out.append(mixed.permute(2, 0, 1, 3).reshape(q.shape[0], -1, dim))
    return torch.cat(out)


def valid_mask(layer, num_heads: int, num_entries: int) -> torch.Tensor:
    """[H, n]: the layer's explicit validity, entries past it (appended since) valid."""
    if layer.valid is None:
        return torch.ones(num_heads, num_entries, dtype=torch.bool)
    return F.pad(layer.valid, (0, num_entries - layer.valid.shape[1]), value=True)


def gated_layer_step(plan, layer, layer_idx: int, queries: torch.Tensor, query_positions: torch.Tensor,
                     output: torch.Tensor, cache: PagedKV, block_ids: torch.Tensor, scale: float) -> None:
    state = plan.state
    runtime = state.gate
    n = plan.cache_len
    num_heads = cache.num_heads
    valid = valid_mask(layer, num_heads, n)
    in_prompt = query_positions < runtime.prompt_len
    if bool(in_prompt[0]):  # a prompt chunk: the gate judges its tokens
        flags, layer.gate_past = state.policy.gate_flags(runtime.gates[layer_idx], queries, query_positions,
                                                          runtime.rope_theta, layer.gate_past)
        _count_gate_decisions(layer_idx, flags[:, in_prompt])
        # after a preemption the recompute chunk also holds generated tokens: never gated, always kept
        valid[:, n - queries.shape[0] :] = flags | ~in_prompt
        layer.valid = valid
        if not bool(in_prompt[-1]) or int(query_positions[-1]) + 1 == runtime.prompt_len:
            layer.gate_past = None  # the gate does not run in decode
    keys, values = read_entries(cache, block_ids, n)
    positions = layer.positions(num_heads, n, state.offset)
    if not bool(valid.all()):  # every entry visible: vLLM's output is already the masked attention
        attended = masked_attention(queries, query_positions, keys, values, positions, valid, scale)
        output[plan.query_start : plan.query_end] = attended.to(output.dtype)
    if plan.compaction is None:
        return
    keep, counts = state.policy.ragged_keep(valid, plan.compaction.keep_tokens)
    slots = torch.arange(keep.shape[1])[None, :]
    kept_here = slots < counts[:, None]
    # a shorter head's padding slots stay where they are (masked out): the compaction then moves only entries
    # from later to earlier slots, which its in-place kernel requires
    compact_entries(cache, block_ids, torch.where(kept_here, keep, slots))
    layer.kept_positions = positions.gather(1, keep).masked_fill(~kept_here, -1)  # padding matches no query
    layer.valid = kept_here
    plan.kept_tokens = max(plan.kept_tokens or 0, keep.shape[1])


def pad_layers_to(state, kept_tokens: int) -> None:
    """After the step: layers that kept fewer than the request's common length carry padding up to it."""
    for layer in state.layers.values():
        if layer.kept_positions is None or layer.kept_positions.shape[1] >= kept_tokens:
            continue
        extra = kept_tokens - layer.kept_positions.shape[1]
        layer.kept_positions = F.pad(layer.kept_positions, (0, extra), value=-1)
        layer.valid = F.pad(layer.valid, (0, extra), value=False)


def _count_gate_decisions(layer_idx: int, flags: torch.Tensor) -> None:
    series = metrics()
    if layer_idx == 0:
        series.gate_tokens_judged.inc(flags.shape[1])
    for head, kept in enumerate(flags.sum(dim=1).tolist()):
        series.gate_tokens_kept.labels(layer=str(layer_idx), kv_head=str(head)).inc(kept)
