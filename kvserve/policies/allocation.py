"""How a request's entries are spread over its layers and KV heads (`kv_allocation`), and span scores (`kv_span`).

`kv_budget` B is the AVERAGE number of entries per (layer, KV head): with L layers and H KV heads, every allocation
keeps L*H*B entries in all, so they use the same memory and differ only in where it goes.

- `uniform`: every (layer, head) keeps B.
- `heads` (Ada-KV: "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference",
  Feng et al. 2024, arXiv:2407.11550): a layer keeps H*B; each head first keeps its best `floor` entries, then the
  layer's best remaining scores, over all its heads together, fill the rest.
- `global` (as KV-Compress sorts one metric across a request's layers and heads: "KV-Compress: Paged KV-Cache
  Compression with Variable Compression Rates per Attention Head", Rehg 2024, arXiv:2410.00161): the same rule over
  all layers at once, with each layer's scores normalised to sum to 1 so that layers compare.
- `pyramid` ("PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", Cai et al. 2024,
  arXiv:2406.02069): a per-layer budget falling linearly from the first layer to the last, the same for every head
  of a layer.

The floor (Ada-KV's safeguard): no (layer, head) keeps fewer than its policy's protected entries or FLOOR_SHARE * B.

Spans (ChunkKV: "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference", Liu et
al. 2025, arXiv:2502.00299): with `kv_span` S every entry is scored by the sum of its span's scores, the span being
the S consecutive token positions it belongs to (position // S), so whole spans are kept or evicted together.
"""

from __future__ import annotations

import math

import torch

ALLOCATIONS = ("uniform", "heads", "global", "pyramid")
FLOOR_SHARE = 0.2  # Ada-KV's safeguard share of the budget every head keeps
PYRAMID_BETA = 20  # PyramidKV: the last layer's budget is B / beta (its default), the first 2B minus that


def head_floor(budget: int, protected: int) -> int:
    """Entries no (layer, head) keeps fewer of: its protected ones, and at least FLOOR_SHARE of the budget."""
    return min(budget, max(protected, math.ceil(FLOOR_SHARE * budget)))


def pyramid_budgets(budget: int, num_layers: int, minimum: int) -> list[int]:
    """PyramidKV's per-layer budgets: linear from 2B - B/beta (first layer) to B/beta (last), never below `minimum`,
    rounded so that they sum to exactly num_layers * budget (the largest fractional parts round up, earlier layers
    first on ties)."""
    if num_layers == 1:
        return [budget]
    low = min(budget, max(minimum, budget // PYRAMID_BETA))
    high = 2 * budget - low
    exact = [high - (high - low) * layer / (num_layers - 1) for layer in range(num_layers)]
    budgets = [math.floor(value) for value in exact]
    missing = num_layers * budget - sum(budgets)
    by_fraction = sorted(range(num_layers), key=lambda layer: (-(exact[layer] - budgets[layer]), layer))
    for layer in by_fraction[:missing]:
        budgets[layer] += 1
    return budgets


def span_scores(scores: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
    """[H, n] -> [H, n]: each entry's score replaced by the sum of the scores of its head's entries in the same span
    of `span` token positions (padding, position -1, scores nothing and gets nothing)."""
    if span == 1:
        return scores
    real = positions >= 0
    span_ids = torch.where(real, positions // span, 0).long()
    sums = torch.zeros(scores.shape[0], int(span_ids.max()) + 1, dtype=scores.dtype, device=scores.device)
    sums.scatter_add_(1, span_ids, torch.where(real, scores, torch.zeros_like(scores)))
    return torch.where(real, sums.gather(1, span_ids), scores)


def ranked(scores: torch.Tensor, protected: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """[H, n] ranking keys: protected entries first, padding last, higher scores before lower (float32)."""
    keys = scores.float().masked_fill(protected, float("inf"))
    return keys if padding is None else keys.masked_fill(padding, float("-inf"))


def shares(keys: list[torch.Tensor], total: int, floor: int, limits: list[torch.Tensor]) -> list[torch.Tensor]:
    """How many entries each (layer, head) keeps: each its best `floor` (or all it holds, if fewer), then the best
    remaining keys of all the given layers and heads together until `total` are kept.

    keys: per layer [H, n_l] ranking keys (see `ranked`), comparable across everything passed in; limits: per layer
    [H] entries each head holds. Ties go to the earlier layer, then the earlier head, then the earlier token."""
    counts = [lim.clamp(max=floor).long() for lim in limits]
    candidates, owners = [], []
    for layer, (layer_keys, lim) in enumerate(zip(keys, limits, strict=True)):
        order = torch.sort(layer_keys, dim=-1, descending=True, stable=True).values  # each head's keys, best first
        slots = torch.arange(order.shape[1], device=order.device)[None, :]
        rest = (slots >= counts[layer][:, None]) & (slots < lim[:, None])  # beyond the floor, within the head
        head_ids = torch.arange(order.shape[0], device=order.device)[:, None].expand_as(order)
        candidates.append(order[rest])
        owners.append(torch.stack([torch.full_like(head_ids[rest], layer), head_ids[rest]], dim=1))
    remaining = total - sum(int(c.sum()) for c in counts)
    if remaining > 0 and candidates:
        pool, who = torch.cat(candidates), torch.cat(owners)
        # candidates are already in (layer, head, rank) order, so a stable sort breaks ties towards earlier ones
        best = torch.sort(pool, descending=True, stable=True).indices[:remaining]
        for layer, head in who[best].tolist():
            counts[layer][head] += 1
    return counts


def top_counts(keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[H, n] ranking keys and [H] counts -> keep indices [H, max count]: head h's `counts[h]` best entries ascending,
    then filler (ignored beyond its count)."""
    width = max(int(counts.max()), 1)
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :width]
    slots = torch.arange(width, device=keys.device)[None, :]
    keyed = torch.where(slots < counts[:, None], order, order + keys.shape[1])  # kept ones sort first
    return torch.sort(keyed, dim=-1).values.remainder(keys.shape[1])


def normalised(scores: torch.Tensor, protected: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """A layer's scores as a distribution over its unprotected real entries (all heads together), so that layers
    compare: `global` ranks these."""
    free = ~protected if padding is None else ~protected & ~padding
    weights = torch.where(free, scores.float().clamp(min=0), torch.zeros_like(scores, dtype=torch.float32))
    return weights / weights.sum().clamp(min=torch.finfo(torch.float32).tiny)


def whole_pages(
    counts: list[torch.Tensor], total_pages: int, block_size: int, min_pages: int, limits: list[torch.Tensor]
) -> list[torch.Tensor]:
    """`counts` (per layer [H] entries, from `shares`) rounded to whole pages of `block_size` entries, `total_pages`
    pages in all (largest remainders first, ties to the earlier list), every list at least `min_pages` and at most
    the whole pages it holds. A compressed document is published as whole blocks (`kvserve/worker/checkpoints.py`),
    so each of its lists must end at a page's end and together they must fill whole blocks."""
    exact = torch.cat([c.double() for c in counts]) / block_size
    most = torch.cat([lim.long() for lim in limits]) // block_size
    low = torch.full_like(most, min_pages).minimum(most)
    pages = exact.floor().long().clamp(min=0).maximum(low).minimum(most)
    missing = total_pages - int(pages.sum())
    remainder = exact - pages.double()
    while missing != 0:
        room = pages < most if missing > 0 else pages > low
        if not bool(room.any()):
            break
        order = torch.sort(
            torch.where(room, remainder, float("-inf") if missing > 0 else float("inf")),
            descending=missing > 0,
            stable=True,
        ).indices
        step = order[: min(abs(missing), int(room.sum()))]
        pages[step] += 1 if missing > 0 else -1
        remainder[step] -= 1 if missing > 0 else -1
        missing = total_pages - int(pages.sum())
    return list((pages * block_size).split([len(c) for c in counts]))
