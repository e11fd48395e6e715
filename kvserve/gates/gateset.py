"""All layers' gates of one model, saved as one small safetensors file with its hyperparameters and recipe."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kvserve.gates.module import GateHyper, LayerGate


class GateSet(nn.Module):
    def __init__(self, num_layers: int, in_dim: int, num_kv_heads: int, hyper: GateHyper) -> None:
        super().__init__()
        self.hyper = hyper
        self.in_dim = in_dim
        self.num_kv_heads = num_kv_heads
        self.gates = nn.ModuleList(LayerGate(in_dim, num_kv_heads, hyper) for _ in range(num_layers))

    def __getitem__(self, layer: int) -> LayerGate:
        return self.gates[layer]

    def __len__(self) -> int:
        return len(self.gates)

    def save(self, path: str | Path, recipe: dict) -> str:
        """Weights in float16 (the file ships in the repository); returns the file's sha256."""
        tensors = {name: t.detach().to(torch.float16).contiguous() for name, t in self.state_dict().items()}
        metadata = {
            "hyper": json.dumps(asdict(self.hyper)),
            "num_layers": str(len(self)),
            "in_dim": str(self.in_dim),
            "num_kv_heads": str(self.num_kv_heads),
            "recipe": json.dumps(recipe),
        }
        save_file(tensors, str(path), metadata=metadata)
        return file_sha256(path)

    @classmethod
    def load(cls, path: str | Path) -> GateSet:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
        gates = cls(
            int(metadata["num_layers"]),
            int(metadata["in_dim"]),
            int(metadata["num_kv_heads"]),
            GateHyper(**json.loads(metadata["hyper"])),
        )
        gates.load_state_dict({name: t.float() for name, t in load_file(str(path)).items()})
        gates.recipe = json.loads(metadata.get("recipe", "{}"))
        return gates.eval().requires_grad_(False)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
