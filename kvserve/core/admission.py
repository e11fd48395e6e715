"""Which waiting request goes first: those that can resume from a live checkpoint (`kv_checkpoint`).

A checkpoint is cheap to keep (the budget's pages) and dear to lose: its next turn recomputes the whole
conversation, and a recompute holds the full prompt until its first compaction, which evicts more checkpoints in a
small pool (measured in `kvserve bench chat`: from 39 of 40 later turns resumed to 8 when the first turns' recomputes
were admitted ahead). Admitting requests that hit first is the longest-prefix-match ordering of SGLang ("SGLang:
Efficient Execution of Structured Language Model Programs", arXiv 2312.07104); a request that has waited
`OVERTAKE_LIMIT_S` is no longer overtaken, so none starves. The scheduler applies it only under the first-come-
first-served policy: with priorities, the priorities decide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

OVERTAKE_LIMIT_S = 30.0  # a waiting request is overtaken by ones that resume from a checkpoint for this long at most

Waiting = TypeVar("Waiting")


def resumable_first(
    waiting: Sequence[Waiting], resumes: Callable[[Waiting], bool], arrival: Callable[[Waiting], float], now: float
) -> list[Waiting]:
    """`waiting` (oldest first) reordered: those that waited `OVERTAKE_LIMIT_S` or more and cannot resume, then those
    that can resume, then the rest, each group in its order."""
    can = [request for request in waiting if resumes(request)]
    cannot = [request for request in waiting if not resumes(request)]
    waited = [request for request in cannot if now - arrival(request) >= OVERTAKE_LIMIT_S]
    overtaken = [request for request in cannot if now - arrival(request) < OVERTAKE_LIMIT_S]
    return waited + can + overtaken
