"""Rotary position embedding (RoPE) as a policy sees it: the cosines and sines the model rotates its queries and keys
by, per position and pair of dimensions.

The engine reads the table from the model itself (vLLM's rotary module of each layer), so every RoPE variant vLLM
implements (linear, NTK, YaRN, Llama 3 scaling) arrives as the model computes it; `Rotary.default` builds Llama's
plain table for tests and references. Pure PyTorch, like the rest of `kvserve.policies`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Rotary:
    cos: torch.Tensor  # [P, R/2] float32: position p, rotated pair i
    sin: torch.Tensor  # [P, R/2]
    neox: bool = True  # pairs (i, i + R/2), as Llama and GPT-NeoX rotate; False: (2i, 2i + 1), as GPT-J does

    @classmethod
    def default(cls, head_dim: int, theta: float, positions: int, rotary_dim: int | None = None) -> Rotary:
        """Llama's RoPE without scaling: angle p * theta^(-2i/R) for pair i of the first R = rotary_dim dims."""
        rotary_dim = rotary_dim or head_dim
        inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        return cls(angles.cos().float(), angles.sin().float())

    @property
    def positions(self) -> int:
        return self.cos.shape[0]

    @property
    def rotary_dim(self) -> int:
        return 2 * self.cos.shape[1]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., D] times the block-diagonal matrix with 2x2 blocks [[cos, -sin], [sin, cos]] per pair ([..., R/2]
        each, broadcast against x's leading dims); dims past R stay as they are."""
        x = x.float()
        half = self.cos.shape[1]
        rotated, rest = x[..., : 2 * half], x[..., 2 * half :]
        first, second = self._pairs(rotated)
        new_first, new_second = first * cos - second * sin, first * sin + second * cos
        if self.neox:
            out = torch.cat([new_first, new_second], dim=-1)
        else:
            out = torch.stack([new_first, new_second], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1)

    def _table_at(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions`, on `device` (the table stays where it was built; x may be on a GPU)."""
        positions = positions.to(self.cos.device)
        return self.cos[positions].to(device), self.sin[positions].to(device)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, ..., D] rotated to `positions` [n], as the model rotates its queries and keys (float32)."""
        cos, sin = self._table_at(positions, x.device)
        shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        return self.apply(x, cos.view(shape), sin.view(shape))

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, ..., D] rotated at `positions` [n] back to its unrotated form. A scaled table (YaRN multiplies cos and
        sin by a constant) is inverted too: the inverse of m * Rot(a) is Rot(-a) / m."""
        inverse = self._inverse_at(positions, x.device)
        shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (inverse.shape[2],)
        return self.apply(x, inverse[:, 0].view(shape), inverse[:, 1].view(shape))

    def pair_weights(self, weight: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear map's weight [O, heads * D] over unrotated vectors, arranged for `unrotated_linear`: [2 * heads *
        R, O], its columns of the rotated dims, then the same with each pair's two columns (w1, w2) made (w2, -w1);
        and [heads * (D - R), O], its columns of the dims past R."""
        w = weight.float().view(weight.shape[0], heads, -1)
        rotated = w[..., : self.rotary_dim]
        first, second = self._pairs(rotated)
        swapped = torch.empty_like(rotated)
        new_first, new_second = self._pairs(swapped)
        new_first.copy_(second)
        new_second.copy_(-first)
        both = torch.cat([rotated.flatten(1), swapped.flatten(1)], dim=1)
        return both.T.contiguous(), w[..., self.rotary_dim :].flatten(1).T.contiguous()

    def unrotated_linear(
        self, x: torch.Tensor, positions: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """[n, O]: the linear map `weights` (`pair_weights`) of x [n, heads, D] unrotated from `positions` [n], without
        the unrotated copy. Unrotating pair (f, g) by (c, s) gives (f c - g s, f s + g c), so a row (w1, w2) of the
        map reads c * (w1 f + w2 g) + s * (w2 f - w1 g): the map of x scaled by c plus the swapped map of x scaled by
        s, one product. Unrotating first took about 10 passes over the queries, most of KVzap's cost per step."""
        both_w, rest_w = weights
        inverse = self._inverse_at(positions, x.device)  # [n, 2, R/2]: (c, s) of each pair
        n = x.shape[0]
        rotated = x[..., : self.rotary_dim]
        if self.neox:  # [n, 2 (c, s), heads, 2 (f, g), R/2]
            scaled = rotated.unflatten(-1, (2, -1))[:, None] * inverse[:, :, None, None, :]
        else:  # [n, 2 (c, s), heads, R/2, 2 (f, g)]
            scaled = rotated.unflatten(-1, (-1, 2))[:, None] * inverse[:, :, None, :, None]
        y = scaled.float().reshape(n, -1) @ both_w
        if rest_w.shape[0]:
            y = y + x[..., self.rotary_dim :].reshape(n, -1).float() @ rest_w
        return y

    @cached_property
    def _inverse(self) -> torch.Tensor:
        """[P, 2, R/2]: the cos and sin that unrotate each position (a scaled table's too: Rot(-a) / m)."""
        norm = self.cos.square() + self.sin.square()
        return torch.stack([self.cos / norm, -self.sin / norm], dim=1)

    def _inverse_at(self, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[n, 2, R/2]: `_inverse` at `positions`, on `device`."""
        return self._inverse[positions.to(self.cos.device)].to(device)

    def _pairs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the (first, second) elements of every rotated pair of x [..., R]."""
        half = self.rotary_dim // 2
        return (x[..., :half], x[..., half:]) if self.neox else (x[..., 0::2], x[..., 1::2])

    def mean_matrix(self, first: int, count: int, head_dim: int) -> torch.Tensor:
        """[D, D] the average of the rotation matrices of positions first .. first + count - 1 (clipped to the
        table): by linearity, the expected rotation of a query whose position is uniform over them."""
        last = min(first + count, self.positions)
        first = min(first, last - 1)
        cos, sin = self.cos[first:last].mean(dim=0), self.sin[first:last].mean(dim=0)
        return self.apply(torch.eye(head_dim, device=self.cos.device), cos, sin).T  # rows R e_i, transposed
