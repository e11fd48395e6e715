"""One layer's step for a request under a ragged policy (Attention-Gate): gate the prompt chunk, attend with the
per-head keep mask, and compact each head's kept entries to the front of its own page list.

Each (layer, KV head) list holds only what its gate kept, so vLLM's kernel already attends to the right entries
except within the prompt, where a token the gate flagged out is hidden from every later query at once (Eq. 4/7 of
"In-context KV-Cache Eviction for LLMs via Attention-Gate", arXiv:2410.12876) but stays in the list until the
prompt's compaction. Only then are the request's output rows recomputed here with the mask: a query sees an entry if
it is its own token, or an earlier token that is valid for that KV head (kvserve's CPU kernel applies the mask to its
logits in one pass over the pages; `masked_attention` is the PyTorch path where the kernel does not read the cache).
"""

from __future__ import annotations

import time

import torch
from kvserve_kernels import cpu as cpu_kernel

from kvserve.metrics import metrics
from kvserve.worker.layouts import CachePages

QUERY_CHUNK = 256  # queries per masked-attention slice: bounds the [H, G, q, n] temporary in a long prefill


def masked_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    recent: int = 0,
) -> torch.Tensor:
    """queries [m, Hq, D] at positions [m]; entries [H, n, D] at key_positions [H, n], valid [H, n] -> [m, Hq, D].
    A query sees its own entry, earlier valid ones, and (`recent`, the gates' window) the `recent` just before it."""
    num_heads, _, dim = keys.shape
    out = []
    for start in range(0, queries.shape[0], QUERY_CHUNK):
        q = queries[start : start + QUERY_CHUNK].float()
        q_pos = query_positions[start : start + QUERY_CHUNK]
        grouped = q.reshape(q.shape[0], num_heads, -1, dim).permute(1, 2, 0, 3)  # [H, G, q, D]
        logits = torch.einsum("hgqd,hnd->hgqn", grouped, keys.float()) * scale
        own = key_positions[:, None, :] == q_pos[None, :, None]  # [H, q, n]
        earlier = key_positions[:, None, :] < q_pos[None, :, None]
        seen = (
            valid[:, None, :] | (key_positions[:, None, :] >= q_pos[None, :, None] - recent)
            if recent
            else valid[:, None, :]
        )
        earlier = earlier & seen
        logits = logits.masked_fill(~(own | earlier)[:, None], float("-inf"))
        mixed = torch.einsum("hgqn,hnd->hgqd", torch.softmax(logits, dim=-1), values.float())
        out.append(mixed.permute(2, 0, 1, 3).reshape(q.shape[0], -1, dim))
    return torch.cat(out)


def valid_mask(layer, lengths: torch.Tensor) -> torch.Tensor:
    """[H, max(lengths)]: the layer's explicit validity, entries past it valid, entries past a head's length not."""
    width = int(lengths.max())
    valid = torch.ones(lengths.shape[0], width, dtype=torch.bool)
    if layer.valid is not None:
        valid[:, : layer.valid.shape[1]] = layer.valid[:, :width]
    return valid & (torch.arange(width)[None, :] < lengths[:, None])


def gated_layer_step(
    plan,
    layer,
    layer_idx: int,
    queries: torch.Tensor,
    output: torch.Tensor,
    cache: CachePages,
    table: torch.Tensor,
    scale: float,
) -> None:
    """After the layer's attention: gate a prompt chunk and recompute its output with the mask (unless the attention
    pass did both, `prompt_attention`), then compact at the planned compaction."""
    lengths = plan.lengths(layer_idx).long()
    if layer_idx not in plan.gated_layers:
        valid = gate_chunk(plan, layer, layer_idx, queries, lengths)
        inside = torch.arange(valid.shape[1])[None, :] < lengths[:, None]
        if not bool(valid[inside].all()):  # every entry visible: the pass's output is already the masked attention
            attended = attend(plan, layer, queries, cache, table, scale, lengths, valid)
            output[plan.query_start : plan.query_end] = attended.to(output.dtype)
    if plan.compaction is None:
        return
    state = plan.state
    valid = valid_mask(layer, lengths)
    positions = layer.positions(lengths, state.since)
    keep, counts = state.policy.ragged_keep(valid, plan.compaction.keep_tokens)
    cache.compact(table, keep, counts)
    kept_here = torch.arange(keep.shape[1])[None, :] < counts[:, None]
    layer.kept_positions = positions.gather(1, keep).masked_fill(~kept_here, -1)
    layer.kept_counts = counts.long()
    layer.valid = None  # what is left was kept: all valid
    state.pages.shrink(layer_idx, counts.numpy())


def in_prompt_chunk(plan) -> bool:
    """This step's queries start inside the prompt: the gate judges them."""
    return plan.state.gate is not None and plan.logical_len - (plan.query_end - plan.query_start) < (
        plan.state.gate.prompt_len
    )


def prompt_attention(
    plan, layer, layer_idx: int, queries: torch.Tensor, cache: CachePages, table: torch.Tensor, scale: float
) -> torch.Tensor:
    """In the attention pass, instead of vLLM's op: gate the prompt chunk (the gate's time counts as the request's
    eviction work) and attend with the mask, one kernel pass. Returns the output rows [q, Hq, D]; the eviction step
    after the pass then only compacts."""
    lengths = plan.lengths(layer_idx).long()
    start = time.perf_counter()
    valid = gate_chunk(plan, layer, layer_idx, queries, lengths)
    plan.eviction_seconds += time.perf_counter() - start
    plan.gated_layers.add(layer_idx)
    return attend(plan, layer, queries, cache, table, scale, lengths, valid)


def gate_chunk(plan, layer, layer_idx: int, queries: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The layer's validity [H, max(lengths)] after this step: a prompt chunk's tokens as its gate flags them
    (stored in `layer.valid`), otherwise as it was."""
    state = plan.state
    runtime = state.gate
    query_positions = plan.query_positions()
    valid = valid_mask(layer, lengths)
    in_prompt = query_positions < runtime.prompt_len
    recent = runtime.gates.hyper.recent
    if in_prompt_chunk(plan):  # the gate judges its tokens (every list got them appended)
        model_layer = state.pages.layout.model_layer(layer_idx)  # the gates are trained per model layer
        flags, layer.gate_past = state.policy.gate_flags(
            runtime.gates[model_layer], queries, query_positions, state.rotary[layer_idx], layer.gate_past
        )
        if recent:  # the prompt's last `recent` tokens are in every later query's window: kept, and counted so
            flags = flags | (query_positions >= runtime.prompt_len - recent)[None, :]
        _count_gate_decisions(model_layer, flags[:, in_prompt])
        # after a preemption the recompute chunk also holds generated tokens: never gated, always kept
        fresh = torch.arange(queries.shape[0])[None, :] + (lengths[:, None] - queries.shape[0])
        valid.scatter_(1, fresh, flags | ~in_prompt)
        layer.valid = valid
        if not bool(in_prompt[-1]) or int(query_positions[-1]) + 1 == runtime.prompt_len:
            layer.gate_past = None  # the gate does not run in decode
    return valid


def attend(
    plan,
    layer,
    queries: torch.Tensor,
    cache: CachePages,
    table: torch.Tensor,
    scale: float,
    lengths: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """The step's queries [q, Hq, D] attending with the per-head mask `valid`: [q, Hq, D] in float32 or the queries'
    dtype."""
    query_positions = plan.query_positions()
    positions = layer.positions(lengths, plan.state.since)
    recent = plan.state.gate.gates.hyper.recent
    if not cache.uses_kernel():
        keys, values = cache.read_lists(table, lengths)
        return masked_attention(queries, query_positions, keys, values, positions, valid, scale, recent)
    num_heads, count = lengths.shape[0], queries.shape[0]
    rows = queries.view(count, num_heads, -1, queries.shape[-1]).transpose(0, 1)  # [H, q, G, D]
    attended, _, _ = cpu_kernel.paged_attention(
        rows, cache.pages, cache.kernel_format, table, lengths, scale,
        valid=valid, key_positions=positions, query_positions=query_positions.expand(num_heads, -1),
        recent=recent, sums=False,
    )  # fmt: skip
    return attended.transpose(0, 1).reshape(count, -1, queries.shape[-1])


def _count_gate_decisions(model_layer: int, flags: torch.Tensor) -> None:
    series = metrics()
    if model_layer == 0:  # one count per token: only the stage that holds layer 0 counts
        series.gate_tokens_judged.inc(flags.shape[1])
    for head, kept in enumerate(flags.sum(dim=1).tolist()):
        series.gate_tokens_kept.labels(layer=str(model_layer), kv_head=str(head)).inc(kept)
