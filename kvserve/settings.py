"""The settings every policy may take, declared once (a policy's own are its knobs: `kvserve/policies/knobs.py`).

Each line says what a user sees of the setting: its request key `kv_<name>` (a top-level body key or in
`vllm_xargs`), its header `x-kv-<name>`, whether a server may default it (`kvserve serve --kv-<name>`, a `--kv-config`
key), its type, the value a request gets when neither it nor the server names one, its range, and which `KVConfig`
field holds it. The parser (`kvserve.config.parse_kv_config`) takes its keys from here, `kvserve serve --help` its
defaults, and docs/reference/settings.md (`python -m kvserve.tools.reference`) every column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.policies import Policy
from kvserve.policies.allocation import ALLOCATIONS
from kvserve.policies.knobs import HEADER_PREFIX, KEY_PREFIX
from kvserve.policy_settings import BUILTIN_CHECKPOINT_POLICY, CHECKPOINT_POLICY_KEY, EVICT_WHEN

MAX_LOOKAHEAD = 512  # question tokens run ahead: its queries are kept per layer until the request ends
# characters of a kv_session: kvserve/server/affinity.py checks it with its own constant (the API server's middleware
# imports that module without torch, which this one loads); tests/test_serve_help.py holds the two equal
MAX_SESSION = 256


@dataclass(frozen=True)
class Setting:
    """One general setting. `probe`: a value that a policy reading the setting accepts (with kv_budget 1024) and one
    that does not read it refuses, which the reference tries on each policy (None: every policy reads it, unless
    `front_end` says); `front_end`: the policies kvserve's HTTP front end serves it for beside those the parser
    takes (kv_lookahead, which the parser never takes; KVzip's checkpoints, served as compressed documents)."""

    key: str
    kind: str  # the type as a user writes it
    help: str
    default: Any = None  # a request's value when neither it nor the server names one (None: see `policy_default`)
    policy_default: str = ""  # the policy class attribute that gives the default instead (`default_span`)
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    server: bool = True  # a server default: `kvserve serve --kv-*` and a `--kv-config` key
    request: bool = True  # a request may give it (header, body key)
    field: str = ""  # the KVConfig field that holds the parsed value ("": the engine never sees it)
    knob: bool = False  # also a policy's own knob (KVzip's kv_document), parsed there for that policy
    parsed: bool = True  # the settings parser takes it (False: the HTTP front end takes it out before)
    probe: Any = None
    front_end: Callable[[type[Policy]], bool] | None = None

    @property
    def name(self) -> str:
        return self.key.removeprefix(KEY_PREFIX)

    @property
    def header(self) -> str:
        return HEADER_PREFIX + self.name.replace("_", "-")

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "kv_policy",
        "str",
        "eviction policy (docs/reference/settings.md lists each policy's own settings)",
        default="full",
        field="policy",
    ),
    Setting(
        "kv_budget",
        "int",
        "entries each (layer, KV head) keeps on average: B; required by every policy but attention_gate (whose "
        "gates choose each head's count, capped by B); above the tokens the policy always keeps",
        minimum=1,
        field="budget",
    ),
    Setting(
        "kv_evict_every_chunk",
        "bool",
        "evict after every prefill chunk, not only after the prompt (bounds a long prompt's cache)",
        default=False,
        field="evict_every_chunk",
    ),
    Setting(
        "kv_allocation",
        "str",
        "how the L x H x B entries spread over layers and heads (B stays the average per layer and KV head); heads "
        "and global rank one score per token, so only score-based policies take them",
        policy_default="default_allocation",
        choices=ALLOCATIONS,
        field="allocation",
        probe="pyramid",
    ),
    Setting(
        "kv_span",
        "int",
        "score-based policies keep whole spans of this many consecutive tokens",
        policy_default="default_span",
        minimum=1,
        field="span",
        probe=2,
    ),
    Setting(
        "kv_evict_when",
        "str",
        "eager: compact at the end of the prompt and every block of new tokens after; pressure: serve as full, "
        "with prefix caching of replies, until the pool is short of blocks",
        default="eager",
        choices=EVICT_WHEN,
        field="evict_when",
        probe="pressure",
    ),
    Setting(
        "kv_checkpoint",
        "int or turns",
        "prompt checkpoints (0: none): turns (compact where each chat turn's prompt ends and by the decode rule "
        "after it) or a token count C (compact at every multiple of C, a multiple of the block size); the compacted "
        "lists enter the prefix cache, so the next chat turn resumes from them",
        default=0,
        minimum=0,
        field="checkpoint",
        probe=1024,
        front_end=lambda cls: cls.reconstructs,  # kvserve/server/checkpoint_documents.py
    ),
    Setting(
        CHECKPOINT_POLICY_KEY,
        "str",
        "the policy of requests with kv_checkpoint=C that name none (without it: the server's eviction kv_policy, "
        "else kvzip); a request names its own with kv_policy",
        default=BUILTIN_CHECKPOINT_POLICY,
        request=False,
        front_end=lambda cls: False,  # it names a policy; none reads it
    ),
    Setting(
        "kv_lookahead",
        "int",
        "T: with kv_evict_every_chunk, kvserve's HTTP front end runs the prompt's last T tokens alone first, and "
        "their queries vote on the compactions inside the prompt (0: off)",
        default=0,
        minimum=0,
        maximum=MAX_LOOKAHEAD,
        server=False,
        front_end=lambda cls: "window_sums" in cls.pass_statistics,  # as kvserve.config.question_refusal
    ),
    Setting(
        "kv_document",
        "int",
        "the prompt's first N tokens are a document compressed once where it ends and published for the next "
        "request that starts with it (KVzip: by its reconstruction; POST /v1/kvserve/compress answers it)",
        default=0,
        minimum=0,
        server=False,
        field="document",
        knob=True,
        probe=2048,
    ),
    Setting(
        "kv_session",
        "str",
        "routes the request: every request of a session goes to one data-parallel engine, where its checkpoints and "
        "compressed documents are; the engine never reads it; the X-Session-ID header (vLLM router's "
        "consistent_hash key, which keeps a session on one server) names it too",
        maximum=MAX_SESSION,
        server=False,
        parsed=False,
        front_end=lambda cls: False,
    ),
)
BY_KEY: dict[str, Setting] = {setting.key: setting for setting in SETTINGS}
# the request keys the parser takes besides the policies' knobs
GENERAL_KEYS: tuple[str, ...] = tuple(
    setting.key for setting in SETTINGS if setting.request and setting.parsed and not setting.knob
)
