"""Rotary position embedding (RoPE) as a policy sees it: the cosines and sines the model rotates its queries and keys
by, per position and pair of dimensions.

The engine reads the table from the model itself (vLLM's rotary module of each layer), so every RoPE variant vLLM
implements (linear, NTK, YaRN, Llama 3 scaling) arrives as the model computes it; `Rotary.default` builds Llama's
plain table for tests and references. Pure PyTorch, like the rest of `kvserve.policies`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        if self.neox:
            first, second = rotated[..., :half], rotated[..., half:]
        else:
            first, second = rotated[..., 0::2], rotated[..., 1::2]
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
        cos, sin = self._table_at(positions, x.device)
        norm = cos.square() + sin.square()
        shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        return self.apply(x, (cos / norm).view(shape), (-sin / norm).view(shape))

    def mean_matrix(self, first: int, count: int, head_dim: int) -> torch.Tensor:
        """[D, D] the average of the rotation matrices of positions first .. first + count - 1 (clipped to the
        table): by linearity, the expected rotation of a query whose position is uniform over them."""
        last = min(first + count, self.positions)
        first = min(first, last - 1)
        cos, sin = self.cos[first:last].mean(dim=0), self.sin[first:last].mean(dim=0)
        return self.apply(torch.eye(head_dim, device=self.cos.device), cos, sin).T  # rows R e_i, transposed
