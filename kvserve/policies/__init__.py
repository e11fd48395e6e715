"""Eviction policies by the names users type. `full` means no eviction.

`<base>+caote` and `<base>+fastcaote` exist for every score-based base policy (CAOTE is a meta-score).
"""

from __future__ import annotations

from kvserve.policies.ahakv import AhaKV
from kvserve.policies.attention_gate import AttentionGate
from kvserve.policies.base import Knob, LayerObservation, Policy, ScoredPolicy, Selection
from kvserve.policies.caote import caote_variant
from kvserve.policies.ems import EMS
from kvserve.policies.h2o import H2O
from kvserve.policies.mat import MAT
from kvserve.policies.snapkv import SnapKV
from kvserve.policies.streamingllm import StreamingLLM
from kvserve.policies.tova import TOVA

BASE_POLICIES: tuple[type[Policy], ...] = (StreamingLLM, H2O, SnapKV, TOVA, AhaKV, MAT, EMS, AttentionGate)
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in BASE_POLICIES}
for _base in BASE_POLICIES:
    if issubclass(_base, ScoredPolicy):
        for _fast in (False, True):
            _variant = caote_variant(_base, _fast)
            POLICIES[_variant.name] = _variant
POLICY_NAMES: tuple[str, ...] = ("full", *POLICIES)

__all__ = ["POLICIES", "POLICY_NAMES", "AhaKV", "AttentionGate", "EMS", "H2O", "Knob", "LayerObservation", "MAT",
           "Policy", "ScoredPolicy", "Selection", "SnapKV", "StreamingLLM", "TOVA", "caote_variant"]


def settings_table() -> str:
    """The per-policy settings as a Markdown table (the README embeds it; a test keeps the two in sync)."""
    rows = ["| policy | request key | header | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for cls in BASE_POLICIES:
        for name, knob in cls.knobs.items():
            allowed = f" ({', '.join(knob.choices)})" if knob.choices else ""
            rows.append(f"| `{cls.name}` | `kv_{name}` | `x-kv-{name.replace('_', '-')}` | {knob.default} | "
                        f"{knob.help}{allowed} |")
    return "\n".join(rows)
