"""Which trained gate file serves which model: `kvserve/gates/registry.yaml` (or the file `KVSERVE_GATES` names).

A model is matched by its folder (or Hugging Face) name, the last component of vLLM's `--model`. Each entry names the
gate file (relative to the registry file) and its sha256; loading checks the checksum and that the gates were
trained for this model's shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from kvserve.environment import declared

REGISTRY_ENV = declared("KVSERVE_GATES")
DEFAULT_REGISTRY = Path(__file__).parent / "registry.yaml"


class NoGateError(LookupError):
    pass


@dataclass(frozen=True)
class GateEntry:
    model: str
    path: Path
    sha256: str


def registry_path() -> Path:
    return Path(os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY)


def _entries() -> dict[str, GateEntry]:
    path = registry_path()
    try:
        modified = path.stat().st_mtime_ns
    except OSError as exc:
        raise NoGateError(f"cannot read the gate registry {path}: {exc}") from exc
    return _parse_registry(path, modified)


@cache
def _parse_registry(path: Path, modified: int) -> dict[str, GateEntry]:
    """Parsed once per file version: every attention_gate request is validated against it (twice over HTTP)."""
    raw = yaml.safe_load(path.read_text()) or {}
    return {name: GateEntry(name, (path.parent / spec["file"]).resolve(), spec["sha256"]) for name, spec in raw.items()}


def gate_entry(model: str) -> GateEntry:
    """The gate file for vLLM's `--model` value: the served profile's (`kvserve calibrate --gates`), else the
    registry's; NoGateError names the models that have gates."""
    from kvserve.profile import PROFILE_ENV, served_profile

    name = Path(str(model).rstrip("/")).name
    profile = served_profile(name)
    if profile is not None and profile.gates:
        beside = Path(os.environ[PROFILE_ENV]).parent
        return GateEntry(name, (beside / profile.gates["file"]).resolve(), profile.gates["sha256"])
    entries = _entries()
    if name not in entries:
        raise NoGateError(
            f"no trained Attention-Gate for model {name!r} (gates exist for: "
            f"{', '.join(sorted(entries)) or 'none'}; registry {registry_path()}); train one with "
            "`kvserve calibrate MODEL_DIR --gates` (hours on a CPU for a 0.5B model; `kvserve serve` then finds it)"
        )
    return entries[name]


@cache
def load_gates(model: str, num_layers: int, in_dim: int, num_kv_heads: int):
    """The model's GateSet, checked against the registry's checksum and the model's shape (cached per process)."""
    from kvserve.gates.gateset import GateSet, file_sha256

    entry = gate_entry(model)
    digest = file_sha256(entry.path)
    if digest != entry.sha256:
        raise NoGateError(f"gate file {entry.path} has sha256 {digest}, the registry expects {entry.sha256}")
    gates = GateSet.load(entry.path)
    if (len(gates), gates.in_dim, gates.num_kv_heads) != (num_layers, in_dim, num_kv_heads):
        raise NoGateError(
            f"gate file {entry.path} is for {len(gates)} layers x {gates.in_dim} inputs x "
            f"{gates.num_kv_heads} KV heads, the model has {num_layers} x {in_dim} x {num_kv_heads}"
        )
    return gates
