"""The head roles file: one gate value per (layer, KV head) of a model, trained by `kvserve.tools.training.roles`, and
the streaming window (sinks, recent) it was trained for. A request's retrieval fraction f makes the f x L x H heads with
the largest gates retrieval heads; the rest are streaming heads.

Files live in `kvserve/duo/roles/<model name>.json` (the served model's directory name, as the gates registry names
models) and record how they were trained, without machine paths. Any other model gets its roles from its profile
(`kvserve calibrate MODEL`, `kvserve/profile.py`), which `kvserve serve` finds by itself; a profile's roles
win over shipped ones.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

ROLES_DIR = Path(__file__).parent / "roles"


@dataclass(frozen=True)
class HeadRoles:
    model: str
    gates: torch.Tensor  # [L, H] in [0, 1]: how much each KV head's output needs full attention
    sink_tokens: int  # a streaming head's window: the first `sink_tokens` and the `recent` newest tokens
    recent: int

    def retrieval(self, fraction: float) -> torch.Tensor:
        """[L, H] bool: the round(fraction x L x H) heads with the largest gates (ties: earlier layer, then head)."""
        count = round(fraction * self.gates.numel())
        order = torch.sort(self.gates.flatten(), descending=True, stable=True).indices[:count]
        chosen = torch.zeros(self.gates.numel(), dtype=torch.bool)
        chosen[order] = True
        return chosen.view_as(self.gates)

    def save(self, path: Path, recipe: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "model": self.model,
            "sink_tokens": self.sink_tokens,
            "recent": self.recent,
            "gates": [[round(float(g), 6) for g in layer] for layer in self.gates],
            "recipe": recipe,
        }
        path.write_text(json.dumps(record, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> HeadRoles:
        record = json.loads(path.read_text())
        return cls(record["model"], torch.tensor(record["gates"]), record["sink_tokens"], record["recent"])

    @classmethod
    def for_model(cls, model_name: str, num_kv_heads: int) -> HeadRoles:
        """The roles of a model (by its directory name): its served profile's, else the shipped ones, checked against
        its KV heads; a clear error when there are none."""
        from kvserve.profile import PROFILE_ENV, served_profile

        profile = served_profile(model_name) if model_name else None
        path = ROLES_DIR / f"{Path(model_name).name}.json"
        if profile is not None:
            measured = profile.roles
            roles = cls(profile.model, measured.gates, measured.sink_tokens, measured.recent)
            source = os.environ[PROFILE_ENV]
        elif model_name and path.exists():
            roles, source = cls.load(path), path.name
        else:
            known = ", ".join(sorted(p.stem for p in ROLES_DIR.glob("*.json"))) or "none"
            raise ValueError(
                f"no DuoAttention head roles for model {Path(model_name).name!r} (shipped: {known}); measure them "
                "with `kvserve calibrate MODEL_DIR` (minutes; `kvserve serve` then finds them)"
            )
        if roles.gates.shape[1] != num_kv_heads:
            raise ValueError(f"{source} holds roles for {roles.gates.shape[1]} KV heads, the model has {num_kv_heads}")
        return roles


@cache
def roles_for(model_name: str, num_kv_heads: int) -> HeadRoles:
    """`HeadRoles.for_model`, read once per process: the policy asks at every compaction of every layer, the front
    end at every request. (A missing file raises each time: errors are not cached.)"""
    return HeadRoles.for_model(model_name, num_kv_heads)
