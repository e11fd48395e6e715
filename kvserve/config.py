"""Per-request eviction settings: parsing, validation, and server-wide defaults.

A request names its settings as `vllm_xargs` keys (`kv_policy`, `kv_budget`, `kv_<knob>`) or as `x-kv-*` headers
that the server maps onto those keys. They are parsed and validated once (`parse_kv_config`, then against the served
model: `kvserve.model_support.served_settings`) where they enter vLLM, and travel from there as one `KVConfig`: to
the engine core in the request's sampling parameters (`SETTINGS_KEY`, written by vLLM's input validation, the one
gate every request passes), and to the workers in the engine core's step plan.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

from kvserve.document_settings import plain_document, with_document
from kvserve.environment import declared
from kvserve.errors import InvalidSetting
from kvserve.policies import BASE_POLICIES, POLICIES, POLICY_NAMES, Policy
from kvserve.policies.knobs import KEY_PREFIX, parse_bool, parse_int
from kvserve.policy_settings import (
    BUILTIN_CHECKPOINT_POLICY,
    CHECKPOINT_POLICY_KEY,
    allocation_and_span,
    evict_when_of,
    requested_policy,
)
from kvserve.settings import GENERAL_KEYS  # the request keys besides the knobs, declared there

# Server-wide defaults travel to the processes that parse settings (the API server; offline, the one process) here.
DEFAULTS_ENV = declared("KVSERVE_DEFAULTS")
# `kvserve serve`'s defaults without --kv-* (configs/default.yaml says the same): eviction on, SnapKV keeping 1,024
# entries per layer and KV head, with SnapKV's own settings (spans of 8, votes pooled over 31 keys: its class's
# defaults, which every way of naming snapkv gets). Chosen by the quality suite (measured: docs/benchmarks.md, section
# "How much quality do I keep at 8x?"): spans lifted SnapKV on RULER's single needle, and it still reads and
# publishes prefix-cache blocks (allocations heads / global would not).
BUILTIN_DEFAULTS = {
    "kv_policy": "snapkv",
    "kv_budget": 1024,
    CHECKPOINT_POLICY_KEY: BUILTIN_CHECKPOINT_POLICY,
}
# SamplingParams.extra_args key: the validated settings (`KVConfig.to_wire`), written by vLLM's input validation over
# whatever a request brings under that name; the engine core reads them (`settings_from`) and parses nothing.
SETTINGS_KEY = "kvserve_settings"
# Set only by kvserve itself, and refused from clients by the HTTP middleware: the request is a document's
# reconstruction, or one piece of it (`kvserve.server.documents`); the request records its prompt's queries as a
# question's, or its chunk compactions are voted on by those queries (`kvserve.server.lookahead`)
INTERNAL_KEYS = ("kv_reconstruct", "kv_reconstruct_piece", "kv_question_probe", "kv_question", "kv_question_start")


@dataclass(frozen=True)
class KVConfig:
    policy: str = "full"
    budget: int | None = None
    evict_every_chunk: bool = False
    knobs: tuple[tuple[str, Any], ...] = field(default_factory=tuple)  # (field name, value) of the policy's knobs
    allocation: str = "uniform"  # how the L*H*B entries spread over layers and heads (kvserve/policies/allocation.py)
    span: int = 1  # score whole spans of this many token positions (1: single tokens)
    evict_when: str = "eager"  # one of kvserve.policy_settings.EVICT_WHEN
    # compact at every multiple of this many tokens (prompt and decode) instead, publishing the compacted lists there
    # (0: off); see "Prefix caching and checkpoints" in docs/architecture.md
    checkpoint: int = 0
    checkpoint_turns: bool = False  # kv_checkpoint=turns: compact and publish where chat turns end instead
    # the prompt is the policy's document (`document`), an instruction and the document again: compact the document
    # by the model's reconstruction of it and publish it for the requests that start with it (kv_reconstruct)
    reconstruct: bool = False
    # a document reconstructed piece by piece (`kv_reconstruct_piece` KEY:START:END, kvserve/worker/pieces.py): this
    # request's copy is the document's tokens START..END; the pieces' scores meet under KEY, and the piece that ends
    # the document compacts with all of them (piece_end 0: the whole document in one copy)
    piece_key: str = ""
    piece_start: int = 0
    piece_end: int = 0
    # kv_document of a policy that scores by its own queries (not KVzip's knob): the prompt's first N tokens are a
    # document, compacted once where it ends, before the rest of the prompt is read (`document`)
    document_tokens: int = 0
    # kv_lookahead (`kvserve/server/lookahead.py`): the request records its prompt's queries under this key (a probe:
    # the question run alone), or its prefill compactions are voted on by the queries recorded under this key, the
    # question's first token being at position question_start of its prompt
    question_probe: str = ""
    question: str = ""
    question_start: int = 0

    @property
    def defers(self) -> bool:
        """The request compacts only under memory pressure (`kv_evict_when=pressure`)."""
        return self.evict_when == "pressure"

    @property
    def evicts(self) -> bool:
        return self.policy != "full"

    @property
    def checkpoints(self) -> bool:
        """The request compacts at checkpoints and publishes them (`kv_checkpoint`: every C tokens, or chat turns), or
        publishes or resumes from a compressed document (`kv_document`)."""
        return bool(self.checkpoint) or self.checkpoint_turns or bool(self.document)

    @property
    def checkpoints_only(self) -> bool:
        """`kv_checkpoint` (every C tokens or chat turns) is set."""
        return bool(self.checkpoint) or self.checkpoint_turns

    @property
    def document(self) -> int:
        """The prompt's first tokens that are a document compressed once (`kv_document`; 0: none): KVzip's knob, or
        any other policy's `document_tokens`."""
        if not self.evicts:
            return 0
        if not POLICIES[self.policy].reconstructs:
            return self.document_tokens
        return int(dict(self.knobs).get("document", 0))

    @property
    def compresses_document(self) -> bool:
        """It compacts the document and publishes the lists: KVzip's request that reconstructs the document's last
        piece (or the whole document); with any other policy, every request that starts from the document's tokens
        (one that resumes from the compressed document compacts nothing)."""
        if self.document_tokens:  # (set only for an evicting policy that does not reconstruct)
            return True
        return self.reconstruct and (not self.piece_end or self.piece_end == self.document)

    @property
    def ragged(self) -> bool:
        """The policy decides per head how many entries to keep (Attention-Gate); the budget, if any, caps them."""
        return self.evicts and POLICIES[self.policy].ragged

    @cached_property
    def own_counts(self) -> bool:
        """The policy gives each head its own count within the budget (DuoAttention's roles, KVzap's threshold).
        (Computed once per settings object: the scheduler asks at every step.)"""
        return self.evicts and self.make_policy().decides_counts()

    def make_policy(self) -> Policy:
        return POLICIES[self.policy](**dict(self.knobs))

    def to_wire(self) -> dict[str, Any]:
        """The settings as plain values (they travel to the engine core with vLLM's serialised request)."""
        return {**asdict(self), "knobs": [list(knob) for knob in self.knobs]}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> KVConfig:
        """What `to_wire` wrote (validated when it was written)."""
        return cls(**{**wire, "knobs": tuple((name, value) for name, value in wire["knobs"])})

    def prefix_sharing(self) -> PrefixSharing:
        """How this request shares vLLM's prefix cache (`kvserve/vllm/kv_cache_manager.py`)."""
        if not self.evicts:
            return PrefixSharing(reads=True, publishes=True)
        # heads / global decide their counts while they compact, so the pages to keep out of shared blocks are not
        # known beforehand; a gate masks attention inside the prompt, so its keys are not a plain request's
        # (a request that resumes from a compressed document, or reconstructs one of its earlier pieces, never
        # compacts: its allocation changes nothing it reads or computes)
        never_compacts = bool(self.document) and not self.compresses_document
        shares = (
            not self.ragged and not self.own_counts and (self.allocation in ("uniform", "pyramid") or never_compacts)
        )
        queries = self.make_policy().prompt_queries_read() if shares else None
        return PrefixSharing(
            # A compaction after every chunk makes later chunks' keys depend on where chunks end, so such a request
            # reads no hits; nor does it publish: only its first chunk would enter the cache, and that chunk's blocks
            # would need spare blocks to compact out of, past the budget + one chunk it promises to hold.
            reads=queries is not None and not self.evict_every_chunk,
            # (a document's reconstruction publishes only the compressed document: its instruction and copy are no
            # prefix anyone asks for, and plain blocks would need copies that a prompt twice the document's length
            # has no room for near max_model_len)
            publishes=shares and not self.evict_every_chunk and not self.compresses_document,
            computed_tail=max(queries or 0, 1),
            # per-layer budgets round up to a page each: a compaction may need one block beyond cdiv(B, bs)
            spare_blocks=1 if self.allocation == "pyramid" else 0,
        )


@dataclass(frozen=True)
class PrefixSharing:
    reads: bool  # its prompt may start from cached blocks of vLLM's prefix cache
    publishes: bool  # its complete blocks enter the prefix cache until its first compaction
    computed_tail: int = 1  # prompt tokens at the end it always computes (its policy reads their queries)
    spare_blocks: int = 0


POLICY_KEY = "policies"  # server defaults: {policy: {kv_<knob> or kv_span: value}}, one section per policy


def policy_defaults(defaults: dict[str, Any], policy: str) -> dict[str, Any]:
    """The server's defaults for `policy`'s own settings (its knobs and `kv_span`): the top-level ones when `policy`
    is the server's default policy (`kvserve serve --kv-policy P --kv-window 64`: P's window), then those of its
    section under `policies:`; a `<base>+caote` variant takes its base's first. Never another policy's."""
    own: dict[str, Any] = {}
    sections = defaults.get(POLICY_KEY) or {}
    for name in dict.fromkeys([policy.partition("+")[0], policy]):
        if defaults.get("kv_policy") == name:
            own.update({key: value for key, value in defaults.items() if key in knob_keys() or key == "kv_span"})
        own.update(sections.get(name) or {})
    return own


def knob_keys() -> set[str]:
    """Every policy's knob keys (`kv_window`, ...)."""
    return {setting.key for cls in POLICIES.values() for setting in cls.knobs().values()}


def env_defaults() -> dict[str, Any]:
    """The server-wide defaults `kvserve serve` put in DEFAULTS_ENV for this process ({} outside a server)."""
    raw = os.environ.get(DEFAULTS_ENV)
    if not raw:
        return {}
    try:
        defaults = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidSetting(DEFAULTS_ENV, f"is not valid JSON: {exc}") from exc
    if not isinstance(defaults, dict):
        raise InvalidSetting(DEFAULTS_ENV, "must be a JSON object")
    return defaults


def parse_kv_config(request_args: dict[str, Any] | None, defaults: dict[str, Any] | None = None) -> KVConfig:
    """Merge server defaults with a request's `kv_*` keys and validate the result.

    Request keys that do not fit the chosen policy are errors. The server's defaults for a policy's own settings
    (its knobs and `kv_span`: `policy_defaults`) reach that policy only: `kv_window: 32` given for SnapKV is not
    Expected Attention's window; another policy gets its own defaults (span 8 for the score-based ones).
    """
    defaults = env_defaults() if defaults is None else defaults
    request = {k: v for k, v in (request_args or {}).items() if k.startswith(KEY_PREFIX)}
    allowed = set(GENERAL_KEYS) | set(INTERNAL_KEYS) | knob_keys()
    for key in request:
        if key == CHECKPOINT_POLICY_KEY:
            raise InvalidSetting(key, "is a server default (kvserve serve --kv-checkpoint-policy); name kv_policy")
        if key not in allowed:
            raise InvalidSetting(key, f"unknown eviction setting; allowed keys: {', '.join(sorted(allowed))}")

    policy = requested_policy(request, defaults)
    if not isinstance(policy, str) or policy not in POLICY_NAMES:
        raise InvalidSetting(
            "kv_policy",
            _unsupported_combination(policy) or f"unknown policy {policy!r}; allowed: {', '.join(POLICY_NAMES)}",
        )
    if policy == "full":
        stray = [k for k in request if k not in ("kv_policy",)]
        if stray:
            raise InvalidSetting(stray[0], "has no effect with kv_policy=full (no eviction)")
        return KVConfig()

    cls = POLICIES[policy]
    own = policy_defaults(defaults, policy)  # the server's defaults for this policy's own settings, no other's
    knob_names = {setting.key: name for name, setting in cls.knobs().items()}
    document_tokens = plain_document(request, cls.reconstructs)  # (kv_document is KVzip's knob, any other's setting)
    foreign = [k for k in request if k in knob_keys() and k not in knob_names and k != "kv_document"]
    if foreign:
        raise InvalidSetting(foreign[0], f"is not a setting of {policy}; its settings: {_knob_list(cls)}")
    # the policy's own fields parse and check each value; an error names the request key
    policy_obj = cls(
        **{name: request.get(key, own.get(key, cls.knobs()[name].default)) for key, name in knob_names.items()}
    )

    budget: int | None = None
    if "kv_budget" in request or "kv_budget" in defaults:
        budget = parse_int("kv_budget", request.get("kv_budget", defaults.get("kv_budget")))
    elif not cls.ragged:
        raise InvalidSetting("kv_budget", f"is required with kv_policy={policy} (tokens kept per layer and KV head)")
    protected = policy_obj.protected_tokens()
    if budget is not None and budget <= protected:
        raise InvalidSetting(
            "kv_budget", f"must be greater than the {protected} tokens {policy} always keeps, got {budget}"
        )
    every_chunk = parse_bool(
        "kv_evict_every_chunk", request.get("kv_evict_every_chunk", defaults.get("kv_evict_every_chunk", False))
    )
    allocation, span = allocation_and_span(request, defaults, own, policy_obj, budget, protected)
    evict_when = evict_when_of(request, defaults, cls, every_chunk)
    knobs = tuple((name, getattr(policy_obj, name)) for name in cls.knobs())
    config = KVConfig(
        policy=policy,
        budget=budget,
        evict_every_chunk=every_chunk,
        knobs=knobs,
        allocation=allocation,
        span=span,
        evict_when=evict_when,
        document_tokens=document_tokens,
    )
    return _with_question(with_document(_with_checkpoint(config, request, defaults), request), request)


def _with_question(config: KVConfig, request: dict[str, Any]) -> KVConfig:
    """kv_lookahead, which only kvserve's HTTP front end serves (it runs the question first), as the settings it
    writes: `kv_question_probe` on the question's own run, `kv_question` and `kv_question_start` on the request."""
    if "kv_lookahead" in request:
        raise InvalidSetting(
            "kv_lookahead",
            "is served by kvserve's HTTP front end (/v1/completions, /v1/chat/completions), which runs the prompt's "
            "last tokens first; the engine alone cannot",
        )
    probe, key = request.get("kv_question_probe"), request.get("kv_question")
    if probe is not None:
        if key is not None or not config.make_policy().window_size():
            raise InvalidSetting("kv_question_probe", "records a window of queries: a policy with a window, alone")
        return replace(config, question_probe=str(probe))
    if key is None:
        if "kv_question_start" in request:
            raise InvalidSetting("kv_question_start", "needs kv_question")
        return config
    start = parse_int("kv_question_start", request.get("kv_question_start", -1))
    why = "needs kv_question_start, the question's first position in the prompt" if start < 0 else None
    why = why or question_refusal(config)
    if why is not None:
        raise InvalidSetting("kv_question", why)
    return replace(config, question=str(key), question_start=start)


def question_refusal(config: KVConfig) -> str | None:
    """Why this request's prefill compactions cannot be voted on by its question's queries (kv_lookahead), or None."""
    if not config.evicts or "window_sums" not in POLICIES[config.policy].pass_statistics:
        voting = ", ".join(cls.name for cls in BASE_POLICIES if "window_sums" in cls.pass_statistics)
        return f"needs a policy whose window of queries votes ({voting}, ...), not {config.policy}"
    if not config.evict_every_chunk:
        return "votes on prefill chunks' compactions: it needs kv_evict_every_chunk"
    return None


def _with_checkpoint(config: KVConfig, request: dict[str, Any], defaults: dict[str, Any]) -> KVConfig:
    """kv_checkpoint, refused (with the reason) where checkpoints cannot be the same whoever computes them; a server
    default that cannot apply to this request is dropped. The checks that need the engine's block size are in
    `check_against_model`."""
    if "kv_checkpoint" not in request and "kv_checkpoint" not in defaults:
        return config
    raw = request.get("kv_checkpoint", defaults.get("kv_checkpoint"))
    turns = raw == "turns"
    checkpoint = 0 if turns else parse_int("kv_checkpoint", raw)
    if checkpoint < 0:
        raise InvalidSetting("kv_checkpoint", f"must be turns or a token count >= 0 (0: none), got {checkpoint}")
    if checkpoint == 0 and not turns:
        return config
    sharing = config.prefix_sharing()
    window = sharing.computed_tail if sharing.reads else None
    if window is None and config.evicts and POLICIES[config.policy].token_statistics:
        window = 1  # it reads no plain hit, and its checkpoints carry every kept entry's statistics
    why = None
    if config.document:
        why = "kv_document compresses its document once, where the document's reconstruction ends"
    elif config.budget is None:
        why = "a checkpoint compacts the prompt to kv_budget, and none is given"
    elif config.evict_every_chunk:
        why = "kv_evict_every_chunk compacts where the scheduler's chunks end, not at fixed positions"
    elif config.allocation != "uniform":
        why = f"with kv_allocation={config.allocation} the lists keep uneven counts, which fill no whole blocks"
    elif config.own_counts:
        why = f"{config.policy} gives each head its own count (kv_threshold, or trained roles): no whole blocks"
    elif window is None:
        why = (
            f"{config.policy} reads every query of the prompt (or its allocation decides counts while compacting), "
            "so a compacted prefix it computed is not what another request with that prefix would keep"
        )
    elif config.defers:
        why = "kv_evict_when=pressure compacts when the pool is short, so what a prefix holds depends on the load"
    elif not turns and checkpoint < window:
        why = f"must be at least the {window} last queries {config.policy} reads, got {checkpoint}"
    if why is not None:
        if "kv_checkpoint" in request:
            raise InvalidSetting("kv_checkpoint", why)
        return config
    return replace(config, checkpoint=checkpoint, checkpoint_turns=turns)


def _unsupported_combination(policy: Any) -> str | None:
    """Why `<base>+caote` is refused for a base that exists but has no per-token score to rescore."""
    if not isinstance(policy, str) or "+" not in policy:
        return None
    base, _, meta = policy.partition("+")
    if base not in POLICIES or meta not in ("caote", "fastcaote"):
        return None
    rescorable = sorted({name.partition("+")[0] for name in POLICIES if "+" in name})
    why = (
        "it merges evicted entries into kept ones, and CAOTE's error of evicting a token does not model a merge"
        if base == "ems"
        else "it selects by a fixed rule (positions; MAT's anchors by logit rank per layer), not by one score per token"
    )
    return (
        f"{policy!r} is not a supported combination: {meta} rescores a base policy's per-token scores, and "
        f"{base} cannot be rescored ({why}); {meta} applies to: {', '.join(rescorable)}"
    )


def _knob_list(cls: type[Policy]) -> str:
    return ", ".join(setting.key for setting in cls.knobs().values()) or "(none)"


def settings_from(sampling_params: Any) -> KVConfig:
    """The settings a request was validated with (`SETTINGS_KEY` of its sampling parameters). A request that reached
    the engine without vLLM's input validation carries none, and is served without eviction."""
    wire = (getattr(sampling_params, "extra_args", None) or {}).get(SETTINGS_KEY)
    if wire is None:
        return KVConfig()
    try:
        return KVConfig.from_wire(wire)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidSetting(SETTINGS_KEY, f"is not what kvserve's validation writes: {exc}") from exc
