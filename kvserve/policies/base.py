"""The policy interface: what one layer's attention pass exposes, and the keep rule a policy applies to it.

Pure PyTorch, no vLLM import: the engine builds a `LayerObservation` from its cache, tests build one from random
tensors. Shapes: H = KV heads, G = query heads per KV head (GQA), n = cached entries, w = window queries, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class Knob:
    """A per-request setting of a policy: its type, default, and allowed values."""

    kind: type  # int or str
    default: Any
    help: str
    minimum: int | None = None
    choices: tuple[str, ...] | None = None
    odd: bool = False


@dataclass
class LayerObservation:
    layer_idx: int
    keys: torch.Tensor  # [H, n, D] cached keys (post-RoPE), in cache order (= position order per head)
    values: torch.Tensor  # [H, n, D]
    positions: torch.Tensor  # [H, n] logical token positions of the cached entries
    scale: float  # the attention's softmax scale (1/sqrt(D))
    window_queries: torch.Tensor | None = None  # [w, H*G, D] the most recent queries, oldest first
    window_positions: torch.Tensor | None = None  # [w] their logical positions

    @property
    def num_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    def window_attention(self) -> torch.Tensor:
        """Softmax attention of the window queries to the cached keys: [H, G, w, n].

        A query sees only entries at or before its own position (causal by position, not by slot, because a
        window query may be older than entries appended after it).
        """
        assert self.window_queries is not None and self.window_positions is not None
        w, num_q_heads, dim = self.window_queries.shape
        group = num_q_heads // self.num_heads
        queries = self.window_queries.float().reshape(w, self.num_heads, group, dim).permute(1, 2, 0, 3)
        logits = torch.einsum("hgwd,hnd->hgwn", queries, self.keys.float()) * self.scale
        visible = self.positions[:, None, None, :] <= self.window_positions[None, None, :, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        return torch.softmax(logits, dim=-1)


class Policy:
    """Chooses, per KV head, which cached entries survive. Subclasses set `name` and `knobs`."""

    name: ClassVar[str]
    knobs: ClassVar[dict[str, Knob]] = {}

    def __init__(self, **settings: Any) -> None:
        for key, knob in self.knobs.items():
            setattr(self, key, settings.get(key, knob.default))

    def protected_tokens(self) -> int:
        """Entries the policy always keeps; a budget must exceed this."""
        return 0

    def window_size(self) -> int:
        """How many of the most recent queries the policy reads (0: none)."""
        return 0

    def keep_indices(self, obs: LayerObservation, budget: int) -> torch.Tensor:
        """Cache indices to keep, [H, budget], ascending per head."""
        raise NotImplementedError


class ScoredPolicy(Policy):
    """A policy whose whole idea is a score: keep the protected entries plus the top-scoring rest."""

    def score(self, obs: LayerObservation) -> torch.Tensor:
        """[H, n], higher = more worth keeping."""
        raise NotImplementedError

    def protected_mask(self, obs: LayerObservation) -> torch.Tensor:
        """[H, n] entries kept regardless of score."""
        return torch.zeros(obs.num_heads, obs.num_tokens, dtype=torch.bool, device=obs.keys.device)

    def keep_indices(self, obs: LayerObservation, budget: int) -> torch.Tensor:
        scores = self.score(obs).float().masked_fill(self.protected_mask(obs), float("inf"))
        # A stable sort, not topk: equal scores (max pooling makes plateaus) go to the earlier token, on every
        # backend and for every shape, so results are reproducible.
        keep = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :budget]
        return torch.sort(keep, dim=-1).values
