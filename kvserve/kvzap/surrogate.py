"""One model's KVzap surrogates: per layer, a linear map or a one-hidden-layer MLP from a token's queries before RoPE
(flattened over the query heads, [Hq * D]) to each KV head's predicted log KVzip+ score, with the identity of the
model they were trained for (a file is refused for any other). Trained by `kvserve.tools.training.kvzap`; served by
the `kvzap` policy (kvserve/policies/kvzap.py)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvserve.policies.rotary import Rotary


class Surrogate(torch.nn.Module):
    """One layer's predictor: [.., Hq * D] queries before RoPE -> [.., H_kv] log KVzip+ scores."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int | None) -> None:
        super().__init__()
        self.net = (
            torch.nn.Linear(in_dim, out_dim)
            if hidden is None
            else torch.nn.Sequential(torch.nn.Linear(in_dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, out_dim))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float())

    @property
    def device(self) -> torch.device:
        first = self.linear if self.linear is not None else self.net[0]
        return first.weight.device

    @property
    def linear(self) -> torch.nn.Linear | None:
        """The whole map when it is one linear layer (then it can be folded into RoPE's inverse), else None."""
        return self.net if isinstance(self.net, torch.nn.Linear) else None


@dataclass(frozen=True)
class SurrogateSet:
    """Every layer's surrogate with what it was trained for: loading it for another model is refused."""

    kind: str
    model: dict  # `model_identity` of the model it was trained on
    layers: list[Surrogate]
    fit: list[dict] = field(default_factory=list)  # held-out fit per layer

    # per (layer, query heads, RoPE layout): a linear surrogate's weight arranged for Rotary.unrotated_linear
    _folded: dict = field(default_factory=dict, repr=False, compare=False)

    def scores(self, layer: int, queries: torch.Tensor) -> torch.Tensor:
        """[n, Hq, D] or [n, Hq * D] queries before RoPE -> [H_kv, n] predicted log KVzip+ scores."""
        module = self.layers[layer]
        with torch.no_grad():  # (the device read from the module's first layer: `parameters()` walks all modules)
            return module(queries.reshape(queries.shape[0], -1).to(module.device)).T

    def scores_of_rotated(
        self, layer: int, queries: torch.Tensor, positions: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        """`scores` of [n, Hq, D] queries after RoPE at `positions` [n]: a linear surrogate reads them through RoPE's
        inverse folded into its weight (`Rotary.unrotated_linear`), an MLP reads them unrotated."""
        linear = self.layers[layer].linear
        if linear is None:
            return self.scores(layer, rotary.unrotate(queries, positions))
        key = (layer, queries.shape[1], rotary.neox, rotary.rotary_dim, queries.device)
        if key not in self._folded:
            with torch.no_grad():
                weights = rotary.pair_weights(linear.weight, queries.shape[1])
                bias = linear.bias.float()
            self._folded[key] = (weights[0].to(queries.device), weights[1].to(queries.device)), bias.to(queries.device)
        weights, bias = self._folded[key]
        with torch.no_grad():
            return (rotary.unrotated_linear(queries, positions, weights) + bias).T

    def save(self, path: Path) -> None:
        tensors = {f"layers.{i}.{name}": t.contiguous() for i, s in enumerate(self.layers) for name, t in
                   s.net.state_dict().items()}  # fmt: skip
        meta = {"kind": self.kind, "model": json.dumps(self.model), "fit": json.dumps(self.fit)}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Path, model_dir: Path | None = None) -> SurrogateSet:
        """The file's surrogates; with `model_dir`, refused (ValueError naming both models) unless trained for it."""
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        trained_for = json.loads(meta["model"])
        if model_dir is not None:
            check_trained_for(trained_for, model_dir, path)
        tensors = load_file(str(path))
        layers, index = [], 0
        while f"layers.{index}.0.weight" in tensors or f"layers.{index}.weight" in tensors:
            state = {
                k.removeprefix(f"layers.{index}."): v for k, v in tensors.items() if k.startswith(f"layers.{index}.")
            }
            hidden = state["0.weight"].shape[0] if "0.weight" in state else None
            first = state["0.weight" if hidden else "weight"]
            last = state["2.weight" if hidden else "weight"]
            surrogate = Surrogate(first.shape[1], last.shape[0], hidden)
            surrogate.net.load_state_dict(state)
            layers.append(surrogate.eval())
            index += 1
        return cls(meta["kind"], trained_for, layers, json.loads(meta["fit"]))


def check_trained_for(trained_for: dict, model_dir: Path, path: Path) -> None:
    here = model_identity(model_dir)
    if trained_for != here:
        differ = sorted(key for key in here if trained_for.get(key) != here[key])
        raise ValueError(
            f"{path} is a KVzap surrogate for {trained_for.get('name')}, not for {here['name']} (they differ in "
            f"{', '.join(differ)}): train one with `kvserve calibrate {model_dir} --kvzap`"
        )


def model_identity(model_dir: Path) -> dict:
    """What a surrogate must match: the architecture's shape and a digest of layer 0's query projection (a
    fine-tune of the same shape has other weights, and other scores)."""
    from safetensors import safe_open

    config = json.loads((Path(model_dir) / "config.json").read_text())
    digest = hashlib.sha256()
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                if key.endswith("layers.0.self_attn.q_proj.weight"):
                    digest.update(f.get_tensor(key).float().numpy().tobytes())
    return {
        "name": Path(model_dir).name,
        "model_type": config.get("model_type"),
        "layers": config["num_hidden_layers"],
        "heads": config["num_attention_heads"],
        "kv_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
        "hidden_size": config["hidden_size"],
        "q_proj_digest": digest.hexdigest()[:16],
    }
