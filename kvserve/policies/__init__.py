"""Eviction policies by the names users type. `full` means no eviction.

Adding a policy is one file and one line here (docs/adding-a-policy.md). `<base>+caote` and `<base>+fastcaote` exist
for every score-based base policy (CAOTE is a meta-score).
"""

from __future__ import annotations

from kvserve.policies.ahakv import AhaKV
from kvserve.policies.attention_gate import AttentionGate
from kvserve.policies.base import LayerObservation, Policy, ScoredPolicy, Selection
from kvserve.policies.caote import META_SCORES, caote_variant
from kvserve.policies.duo_attention import DuoAttention
from kvserve.policies.ems import EMS
from kvserve.policies.expected_attention import ExpectedAttention
from kvserve.policies.h2o import H2O
from kvserve.policies.keydiff import KeyDiff
from kvserve.policies.knobs import Knob, knob
from kvserve.policies.kvzap import KVzap
from kvserve.policies.kvzip import KVzip
from kvserve.policies.mat import MAT
from kvserve.policies.snapkv import SnapKV
from kvserve.policies.snapkv_keydiff import SnapKVKeyDiff
from kvserve.policies.streamingllm import StreamingLLM
from kvserve.policies.tova import TOVA

# The registry: every policy a request can name is one of these or a meta-score over a scored one.
BASE_POLICIES: tuple[type[Policy], ...] = (
    StreamingLLM,
    H2O,
    SnapKV,
    TOVA,
    AhaKV,
    MAT,
    EMS,
    AttentionGate,
    ExpectedAttention,
    KeyDiff,
    DuoAttention,
    KVzip,
    SnapKVKeyDiff,
    KVzap,
)

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in BASE_POLICIES}
for _base in BASE_POLICIES:
    if issubclass(_base, ScoredPolicy) and not _base.reconstructs:  # (KVzip's score is its document's own)
        for _meta in META_SCORES:
            _variant = caote_variant(_base, _meta == "fastcaote")
            POLICIES[_variant.name] = _variant
POLICY_NAMES: tuple[str, ...] = ("full", *POLICIES)

__all__ = [
    "BASE_POLICIES",
    "POLICIES",
    "POLICY_NAMES",
    "AhaKV",
    "AttentionGate",
    "DuoAttention",
    "EMS",
    "ExpectedAttention",
    "H2O",
    "KVzap",
    "KVzip",
    "KeyDiff",
    "Knob",
    "LayerObservation",
    "MAT",
    "Policy",
    "ScoredPolicy",
    "Selection",
    "SnapKV",
    "SnapKVKeyDiff",
    "StreamingLLM",
    "TOVA",
    "caote_variant",
    "knob",
    "representative_policies",
]


def representative_policies(ragged: bool = True) -> list[str]:
    """One registered name per way a policy runs: every base policy, then each meta-score over the first scored base.

    What engine-level tests and the load mix cycle through, so a newly registered policy is in them at once;
    `ragged=False` leaves out the policies whose heads keep different counts and those that run something trained
    for the served model (gates, head roles, a surrogate), which synthetic layers have none of. KVzip is left out: it
    serves only a compressed document's requests (`kv_document`), which tests/test_documents.py covers."""
    names = [
        cls.name
        for cls in BASE_POLICIES
        if (ragged or not (cls.ragged or cls.own_counts or cls.trained)) and not cls.reconstructs
    ]
    first_scored = next(cls.name for cls in BASE_POLICIES if issubclass(cls, ScoredPolicy))
    return names + [f"{first_scored}+{meta}" for meta in META_SCORES]
