"""Eviction policies by the names users type. `full` means no eviction."""

from __future__ import annotations

from kvserve.policies.base import Knob, LayerObservation, Policy, ScoredPolicy
from kvserve.policies.snapkv import SnapKV
from kvserve.policies.streamingllm import StreamingLLM

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (StreamingLLM, SnapKV)}
POLICY_NAMES: tuple[str, ...] = ("full", *POLICIES)

__all__ = ["POLICIES", "POLICY_NAMES", "Knob", "LayerObservation", "Policy", "ScoredPolicy", "SnapKV", "StreamingLLM"]
