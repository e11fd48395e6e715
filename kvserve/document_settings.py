"""The settings of a document compressed once (`kv_document`) and of KVzip's requests that compress it by its
reconstruction (`kv_reconstruct`, `kv_reconstruct_piece`): part of `parse_kv_config` (kvserve/config.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypeVar

from kvserve.errors import InvalidSetting
from kvserve.policies import POLICIES
from kvserve.policies.knobs import parse_bool, parse_int

KVConfig = TypeVar("KVConfig")  # kvserve.config.KVConfig, which imports this module

# a compressed document's lists keep B each (uniform) or the counts of one ranking over every layer and head
# (global, KVzip's own allotment) or the policy's own (DuoAttention's roles), rounded to whole pages so that they are
# published as whole blocks
DOCUMENT_ALLOCATIONS = ("uniform", "global")


def plain_document(request: dict[str, Any], reconstructs: bool) -> int:
    """`kv_document` of a policy that does not reconstruct (KVzip's is its knob): the document's token count, or 0."""
    if "kv_document" not in request or reconstructs:
        return 0
    tokens = parse_int("kv_document", request["kv_document"])
    if tokens <= 0:
        raise InvalidSetting("kv_document", f"must be the document's token count (> 0), got {tokens}")
    return tokens


def with_document(config: KVConfig, request: dict[str, Any]) -> KVConfig:
    """A document compressed once (`kv_document`): refused with whatever would make its compressed lists depend on
    more than the document and the settings, or unable to fill whole blocks; `kv_reconstruct` marks the request that
    compresses it."""
    reconstruct = parse_bool("kv_reconstruct", request.get("kv_reconstruct", False))
    document = config.document
    if not document:
        if reconstruct or "kv_reconstruct_piece" in request:
            field = "kv_reconstruct" if reconstruct else "kv_reconstruct_piece"
            raise InvalidSetting(field, "needs kv_document: the tokens of the document it reconstructs")
        return config
    why = None
    if reconstruct and config.document_tokens:  # (document_tokens: a policy that does not reconstruct)
        raise InvalidSetting("kv_reconstruct", f"scores a document by its reconstruction; {config.policy} does not")
    if config.budget is None:
        why = "compresses the document to kv_budget, and none is given"
    elif config.budget >= document:
        why = f"must be longer than kv_budget ({config.budget}): a document that fits is not compressed"
    elif (
        config.evict_every_chunk
        or config.allocation not in DOCUMENT_ALLOCATIONS
        or config.defers
        or config.checkpoints_only
    ):
        why = (
            "compresses the document once, where it (or its reconstruction) ends, to kv_budget per list on average: "
            "it takes "
            f"no kv_evict_every_chunk, kv_allocation other than {' or '.join(DOCUMENT_ALLOCATIONS)}, "
            "kv_evict_when=pressure or kv_checkpoint"
        )
    elif config.own_counts and not POLICIES[config.policy].fixed_counts:
        why = (
            f"is published as whole blocks, which {config.policy} cannot fill: kv_threshold gives each head its own "
            "count from its scores"
        )
    if why is not None:
        raise InvalidSetting("kv_document", why)
    return _with_piece(replace(config, reconstruct=reconstruct), request)


def _with_piece(config: KVConfig, request: dict[str, Any]) -> KVConfig:
    """`kv_reconstruct_piece` KEY:START:END (set by the compress route): the request reconstructs the document's
    tokens START..END only."""
    raw = request.get("kv_reconstruct_piece")
    if raw is None:
        return config
    key, _, end = str(raw).rpartition(":")
    key, _, start = key.rpartition(":")
    try:
        first, last = int(start), int(end)
    except ValueError:
        first = last = -1
    if not config.reconstruct or not key or not 0 <= first < last <= config.document:
        raise InvalidSetting(
            "kv_reconstruct_piece",
            f"must be KEY:START:END with 0 <= START < END <= kv_document ({config.document}) on a request with "
            f"kv_reconstruct, got {raw!r}",
        )
    return replace(config, piece_key=key, piece_start=first, piece_end=last)
