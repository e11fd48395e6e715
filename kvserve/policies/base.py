"""The policy interface: what one layer's attention pass exposes, and the keep rule a policy applies to it.

Pure PyTorch, no vLLM import: the engine builds a `LayerObservation` from its cache, tests build one from random
tensors. Shapes: H = KV heads, G = query heads per KV head (GQA), n = cached entries, w = window queries, D = head dim.

A policy may keep running per-entry statistics (H2O's accumulated attention, MAT's anchor logits): `update_stats`
sees every step's queries, and the engine stores what it returns beside the cache, compacts it with the same keep
indices, and frees it with the request. Statistics are [H, n] per name, so their memory is bounded by the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from kvserve.policies.allocation import ranked, top_counts
from kvserve.policies.knobs import Knob, knobs_of
from kvserve.policies.rotary import Rotary


@dataclass
class PassStatistics:
    """What the layer's attention pass measured for this step's queries (the newest cache entries), from the
    operations in `kvserve.worker.kernel_dispatch` (Triton kernels on CUDA, their PyTorch references on CPU). A field
    left None is computed by the observation itself from the keys: the same numbers, so tests need no engine."""

    column_sums: torch.Tensor | None = None  # [H, n] the step's queries' probabilities, summed over queries and group
    first_logits: torch.Tensor | None = None  # [q, H*G] the step's queries' logits to entry 0 (q.k_0 * scale)
    window_sums: torch.Tensor | None = None  # [H, n] the window queries' probabilities, summed (window_logit_scale)


@dataclass
class LayerObservation:
    layer_idx: int  # the model layer (0 = the first), on any pipeline stage
    keys: torch.Tensor  # [H, n, D] cached keys (post-RoPE), in cache order (= position order per head)
    values: torch.Tensor  # [H, n, D]
    positions: torch.Tensor  # [H, n] logical token positions of the cached entries
    scale: float  # the attention's softmax scale (1/sqrt(D))
    window_queries: torch.Tensor | None = None  # [w, H*G, D] the most recent queries, oldest first
    window_positions: torch.Tensor | None = None  # [w] their logical positions
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # running per-entry statistics, [H, n] each
    budget: int = 0  # entries each head keeps at this compaction (0 outside a compaction)
    measured: PassStatistics = field(default_factory=PassStatistics)
    # [H] entries of each head when heads hold different counts (None: all n); a head's entries past its length are
    # padding: zero keys and values, position -1, never attended, never kept
    lengths: torch.Tensor | None = None
    rotary: Rotary | None = None  # how the layer rotates queries and keys by position (None: not given)
    model: str = ""  # the served model's name (its directory's), for policies trained per model (DuoAttention)
    # tensor parallelism: this rank's KV heads are the model's first_head .. first_head + H - 1 of model_heads
    first_head: int = 0
    model_heads: int = 0  # (0: H, one rank holds them all)

    @property
    def num_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def heads(self) -> slice:
        """This rank's KV heads among the model's, for per-head tables of the whole model (trained roles)."""
        return slice(self.first_head, self.first_head + self.num_heads)

    @property
    def total_heads(self) -> int:
        return self.model_heads or self.num_heads

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    def padding(self) -> torch.Tensor | None:
        """[H, n] True for a head's slots past its length (None when every head holds n entries)."""
        if self.lengths is None:
            return None
        slots = torch.arange(self.num_tokens, device=self.lengths.device)
        return slots[None, :] >= self.lengths[:, None]

    def head_budgets(self, budget: int) -> torch.Tensor | None:
        """[H] what each head can keep of `budget` (a head holds fewer entries than it), None when all can."""
        if self.lengths is None:
            return None
        return self.lengths.clamp(max=budget)

    def attention(
        self, queries: torch.Tensor, query_positions: torch.Tensor, logit_scale: torch.Tensor | float = 1.0
    ) -> torch.Tensor:
        """Softmax attention of `queries` [q, H*G, D] to the cached keys, causal by position: [H, G, q, n].

        A query sees only entries at or before its own position (by position, not slot: a window query may be older
        than entries appended after it). `logit_scale` ([H, G, q, 1] or scalar) sharpens the usual logits.
        """
        q, num_q_heads, dim = queries.shape
        group = num_q_heads // self.num_heads
        grouped = queries.float().reshape(q, self.num_heads, group, dim).permute(1, 2, 0, 3)
        logits = torch.einsum("hgqd,hnd->hgqn", grouped, self.keys.float()) * self.scale * logit_scale
        positions = self.positions
        if (
            positions.numel()
            and query_positions.numel()
            and (int(positions.min()) < 0 or int(positions.max()) > int(query_positions.min()))
        ):
            # (no mask where every query sees every entry: a question's queries voting from the prompt's end)
            visible = (positions[:, None, None, :] <= query_positions[None, None, :, None]) & (positions >= 0)[
                :, None, None, :
            ]  # -1: a shorter head's padding
            logits = logits.masked_fill(~visible, float("-inf"))
        return torch.softmax(logits, dim=-1)

    def attention_column_sums(
        self, queries: torch.Tensor, query_positions: torch.Tensor, chunk: int = 256
    ) -> torch.Tensor:
        """Each entry's attention summed over `queries` and the group's query heads: [H, n].

        Chunked over queries, so a long prefill never materialises the whole [q, n] attention matrix.
        """
        total = torch.zeros(self.num_heads, self.num_tokens, device=self.keys.device)
        for start in range(0, queries.shape[0], chunk):
            part = self.attention(queries[start : start + chunk], query_positions[start : start + chunk])
            total += part.sum(dim=(1, 2))
        return total

    def window_attention(self) -> torch.Tensor:
        """Attention of the window queries: [H, G, w, n]."""
        assert self.window_queries is not None and self.window_positions is not None
        return self.attention(self.window_queries, self.window_positions)

    def step_column_sums(self, queries: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """This step's queries' attention summed over them and the group's query heads: [H, n]."""
        if self.measured.column_sums is not None:
            return self.measured.column_sums
        return self.attention_column_sums(queries, query_positions)

    def step_first_logits(self, queries: torch.Tensor) -> torch.Tensor:
        """This step's queries' logits to cache entry 0: [q, H*G]."""
        if self.measured.first_logits is not None:
            return self.measured.first_logits
        group = queries.shape[1] // self.num_heads
        first_key = self.keys[:, 0].float().repeat_interleave(group, dim=0)  # [H*G, D]
        return torch.einsum("qhd,hd->qh", queries.float(), first_key) * self.scale

    def window_votes(self, logit_scale: torch.Tensor | float = 1.0, rows: int | None = None) -> torch.Tensor:
        """The window queries' attention (only the newest `rows` of them, if given) summed over them and the group's
        query heads: [H, n]. The engine measures the policy's `window_size()` newest queries with its
        `window_logit_scale`; a policy passes the same here."""
        if self.measured.window_sums is not None:
            return self.measured.window_sums
        assert self.window_queries is not None and self.window_positions is not None
        first = -rows if rows else 0
        queries, positions = self.window_queries[first:], self.window_positions[first:]
        return self.attention(queries, positions, logit_scale).sum(dim=(1, 2))


@dataclass
class Selection:
    """What a compaction keeps: per head, ascending cache indices; merging policies also give the kept entries' new
    keys and values (same order as `keep_indices`)."""

    keep_indices: torch.Tensor  # [H, B]
    keys: torch.Tensor | None = None  # [H, B, D]
    values: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] | None = None  # the kept entries' statistics, if the policy rewrote them
    keep_counts: torch.Tensor | None = None  # [H] a head keeps only keep_indices[h, :count] (None: all B)


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Chooses, per KV head, which cached entries survive.

    A subclass is a frozen dataclass: it sets `name`, and its fields, each declared with `knob(...)`, are its
    per-request settings (`kv_<field>`). Constructing one checks every setting against its declaration.
    """

    name: ClassVar[str]
    stat_names: ClassVar[tuple[str, ...]] = ()  # running statistics this policy keeps (see update_stats)
    # the statistic that is each entry's attention summed over every query so far (H2O's accumulated attention):
    # update_stats adds the step's column sums to it, which the engine may do from the attention pass's own sums
    # without building an observation
    running_sum: ClassVar[str | None] = None
    # the statistic that holds, per entry, the logit of that entry's own query to entry 0, averaged over the KV head's
    # query heads (MAT's anchor logit): update_stats writes the step's first logits into the newest entries
    first_logit_mean: ClassVar[str | None] = None
    # True: the policy decides each head's count itself (heads keep different counts: "ragged"); kv_budget, then
    # optional, only caps the counts
    ragged: ClassVar[bool] = False
    # True: the policy gives each head its own count from the budget (DuoAttention's roles), not an allocation's
    own_counts: ClassVar[bool] = False
    # True: those counts follow from the budget before any score is read (trained roles, not a threshold), so a
    # compressed document's can be rounded to whole pages together (`kvserve/worker/allocated.py`) and published
    fixed_counts: ClassVar[bool] = False
    # True: the policy runs something trained for the served model (gates, head roles, a surrogate), so it serves
    # only models that have one
    trained: ClassVar[bool] = False
    # True: each entry's statistics are its own token's, computed once as it is written (KVzap's prediction), so
    # keeping them reads no cached entry, and the lists at a checkpoint are the same whoever computed the prompt
    token_statistics: ClassVar[bool] = False
    # what the engine should measure in the attention pass (fields of PassStatistics); window_sums only at compactions
    pass_statistics: ClassVar[tuple[str, ...]] = ()
    # kv_span when neither the request nor the server's defaults for this policy give one (`ScoredPolicy`: 8)
    default_span: ClassVar[int] = 1
    # True: the policy scores a document by the model's reconstruction of it (KVzip), so it serves only requests that
    # compress a document or resume from one (`kv_document`, kvserve/core/checkpoints.py)
    reconstructs: ClassVar[bool] = False
    # kv_allocation when neither the request nor the server's defaults give one
    default_allocation: ClassVar[str] = "uniform"
    # True: the scores mean the same in every layer and head (KVzip's: the attention an entry received), so
    # `kv_allocation=global` ranks them as they are, with no floor beyond the protected entries; False: each layer's
    # scores are normalised first and every head keeps a floor (kvserve/policies/allocation.py)
    comparable_scores: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for knob in self.knobs().values():  # also turns a header's text ("16") into the declared type
            object.__setattr__(self, knob.name, knob.parse(getattr(self, knob.name)))

    @classmethod
    def knobs(cls) -> dict[str, Knob]:
        """The per-request settings this policy declares, by field name."""
        return knobs_of(cls)

    def token_scores(
        self, layer_idx: int, queries: torch.Tensor, query_positions: torch.Tensor, rotary: Rotary | None, model: str,
        heads: slice,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """With `token_statistics`: each statistic of the step's new entries, [H, q], from their own queries
        [q, Hq, D] at `query_positions` alone (model layer `layer_idx`, the model's KV heads `heads`)."""
        raise NotImplementedError

    def decides_counts(self) -> bool:
        """This request's heads keep the counts `head_counts` gives (within the budget), not an allocation's: always
        for a policy with `own_counts`, per request for one whose settings say so (KVzap's threshold)."""
        return self.own_counts

    def head_counts(self, obs: LayerObservation, budget: int) -> torch.Tensor:
        """[H] entries each head keeps at a compaction to `budget`, where `decides_counts`."""
        raise NotImplementedError

    def protected_tokens(self) -> int:
        """Entries the policy always keeps; a budget must exceed this."""
        return 0

    def window_size(self) -> int:
        """How many of the most recent queries the policy reads (0: none)."""
        return 0

    def prompt_queries_read(self) -> int | None:
        """How many of the prompt's last queries this policy's choice depends on. A prefix-cache hit may cover the
        prompt up to that many tokens before its end: the keys before them are the same whoever computed them, so
        the choice is the one made without a hit. None: it reads every query (running statistics, a gate on every
        token), so a request with this policy computes its whole prompt."""
        if self.stat_names or self.ragged:
            return None
        return self.window_size()

    def window_logit_scale(self, obs: LayerObservation) -> torch.Tensor | None:
        """A multiplier of the window queries' logits for their votes, [H, w] (None: the model's own logits)."""
        return None

    def update_stats(
        self, obs: LayerObservation, queries: torch.Tensor, query_positions: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Fold one step's queries [q, H*G, D] into the statistics; `obs.stats` are zero-padded to n entries."""
        column_sums = obs.step_column_sums(queries, query_positions) if self.running_sum is not None else None
        first_logits = obs.step_first_logits(queries) if self.first_logit_mean is not None else None
        return self.fold_step(obs.stats, column_sums, first_logits, obs.num_heads)

    def fold_step(
        self,
        stats: dict[str, torch.Tensor],
        column_sums: torch.Tensor | None,
        first_logits: torch.Tensor | None,
        num_heads: int,
    ) -> dict[str, torch.Tensor]:
        """The `running_sum` and `first_logit_mean` statistics ([H, n], zero-padded to the lists' longest length)
        with one step folded in: plus the step's column sums [H, n]; the newest q entries set from its first logits
        [q, H*G] averaged over each KV head's query heads. New tensors; the engine calls this with the attention
        pass's own numbers, without an observation."""
        stats = dict(stats)
        if self.running_sum is not None:
            stats[self.running_sum] = stats[self.running_sum] + column_sums
        if self.first_logit_mean is not None:
            count = first_logits.shape[0]
            newest = stats[self.first_logit_mean].clone()
            newest[:, newest.shape[1] - count :] = first_logits.reshape(count, num_heads, -1).mean(dim=-1).T
            stats[self.first_logit_mean] = newest
        return stats

    def keep_indices(self, obs: LayerObservation, budget: int) -> torch.Tensor:
        """Cache indices to keep, [H, budget], ascending per head."""
        raise NotImplementedError

    def select(self, obs: LayerObservation, budget: int) -> Selection:
        """What the compaction keeps. Heads holding fewer than `budget` entries (ragged lists) keep all of theirs:
        their padding scores below every real entry, so the first `count` indices are the real ones."""
        return Selection(self.keep_indices(obs, budget), keep_counts=obs.head_budgets(budget))


def written_newest(
    stat: torch.Tensor | None, new: torch.Tensor, lengths: torch.Tensor | None, width: int
) -> torch.Tensor:
    """A per-entry statistic [H, width] whose newest q entries of each head (those before its length, or before
    `width` for all when `lengths` is None) are `new` [H, q]; the older ones are `stat`'s (zero-padded, None: none)."""
    heads, count = new.shape
    out = torch.zeros(heads, width, dtype=new.dtype, device=new.device)
    if stat is not None:
        out[:, : stat.shape[1]] = stat[:, :width]
    ends = lengths.to(new.device) if lengths is not None else torch.full((heads,), width, device=new.device)
    slots = ends[:, None] - count + torch.arange(count, device=new.device)
    return out.scatter_(1, slots.long(), new)


def top_with_protected(
    scores: torch.Tensor, protected: torch.Tensor, budget: int, padding: torch.Tensor | None = None
) -> torch.Tensor:
    """The protected entries plus the highest scores, [H, budget] ascending; `padding` [H, n] (a shorter head's
    slots past its length) sorts after every real entry, so a head with `count` < budget entries gets them first.

    A stable sort, not topk: equal scores (max pooling makes plateaus) go to the earlier token, on every backend and
    for every shape, so results are reproducible.
    """
    scores = scores.float().masked_fill(protected, float("inf"))
    if padding is not None:
        scores = scores.masked_fill(padding, float("-inf"))
        rank = torch.where(padding, 1, 0)  # real entries first, padding last, each by score
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        keep = order.gather(1, torch.sort(rank.gather(1, order), dim=-1, stable=True).indices)[:, :budget]
        real = ~padding.gather(1, keep)
        # a head's real entries ascending, then its padding slots (ignored: beyond its count)
        keyed = torch.where(real, keep, keep + scores.shape[-1])
        return torch.sort(keyed, dim=-1).values.remainder(scores.shape[-1])
    keep = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :budget]
    return torch.sort(keep, dim=-1).values


def percentile_ranks(scores: torch.Tensor) -> torch.Tensor:
    """[H, n] -> [H, n]: each entry's rank within its head, 0 (lowest score) to 1 (ties: the earlier entry lower)."""
    ranks = scores.float().argsort(dim=1, stable=True).argsort(dim=1).float()
    return ranks / max(scores.shape[1] - 1, 1)


def recent_mask(obs: LayerObservation, count: int) -> torch.Tensor:
    """[H, n] True for the last `count` entries."""
    mask = torch.zeros(obs.num_heads, obs.num_tokens, dtype=torch.bool, device=obs.keys.device)
    if count and obs.lengths is None:
        mask[:, -count:] = True
    elif count:  # each head's own last entries
        slots = torch.arange(obs.num_tokens, device=obs.keys.device)[None, :]
        lengths = obs.lengths.to(obs.keys.device)[:, None]
        mask = (slots >= lengths - count) & (slots < lengths)
    return mask


def pool_scores(scores: torch.Tensor, kernel_size: int, mode: str = "avg") -> torch.Tensor:
    """1-D pooling over entries ([H, n] -> [H, n]), same padding, as SnapKV smooths its votes."""
    import torch.nn.functional as F

    if scores.shape[-1] == 0:
        return scores
    pool = F.avg_pool1d if mode == "avg" else F.max_pool1d
    return pool(scores[:, None, :], kernel_size, stride=1, padding=kernel_size // 2)[:, 0, :]


class ScoredPolicy(Policy):
    """A policy whose whole idea is a score: keep the protected entries plus the top-scoring rest."""

    # Score whole spans of 8 token positions unless told otherwise: the quality suite chose span 8 for every
    # score-based policy (docs/benchmarks.md: a passkey's digits are separate tokens, and a per-token ranking kept some
    # digits of a key and dropped others)
    default_span: ClassVar[int] = 8

    def score(self, obs: LayerObservation) -> torch.Tensor:
        """[H, n], higher = more worth keeping."""
        raise NotImplementedError

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        """[H, n] entries kept regardless of score."""
        return torch.zeros(obs.num_heads, obs.num_tokens, dtype=torch.bool, device=obs.keys.device)

    def select_head_counts(self, obs: LayerObservation, budget: int) -> Selection:
        """Each head's `head_counts` entries: its protected ones first, then its best scores (a policy that
        `decides_counts`)."""
        counts = self.head_counts(obs, budget)
        padding = obs.padding()
        protected = self.protected_mask(obs) if padding is None else self.protected_mask(obs) & ~padding
        return Selection(top_counts(ranked(self.score(obs), protected, padding), counts), keep_counts=counts)

    def keep_indices(self, obs: LayerObservation, budget: int) -> torch.Tensor:
        if obs.budget != budget:  # scores that depend on the budget (AhaKV's step gain) must see this one
            obs = replace(obs, budget=budget)
        padding = obs.padding()
        protected = self.protected_mask(obs)
        if padding is not None:
            protected = protected & ~padding
        return top_with_protected(self.score(obs), protected, budget, padding)
