"""Tensor parallelism: the ranks of a stage agree on what a step did before any block goes back.

Under `--tensor-parallel-size N` each rank holds H / N KV heads of every layer in the SAME vLLM blocks and evicts
its own heads, and only rank 0's output reaches the engine core. After each step that ran a forward, the ranks
exchange over the tensor-parallel group's CPU (gloo) group, per compacted request, each rank's `StageRelease` and
every rank's failures. Each rank then holds every rank's counts, so each chooses the same blocks to give back
(`blocks_to_release` is a function of them) and moves its own live pages out of them at once; rank 0 reports every
rank's counts, and the engine core charges the request the most blocks any rank needs. A checkpoint is published
only when every rank's lists fill whole blocks (`agree`).

The ranks run every step together (vLLM broadcasts each schedule to all of them), so the collectives pair up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.messages import StageRelease


@dataclass
class RankMessage:
    releases: dict[str, StageRelease] = field(default_factory=dict)  # req id -> this rank's counts
    failures: dict[str, str] = field(default_factory=dict)  # req id -> why its policy raised on this rank


class TensorRanks:
    """This worker's place among the tensor-parallel ranks of its stage."""

    def __init__(self, group) -> None:
        self.group = group  # vLLM's tensor-parallel GroupCoordinator

    @property
    def size(self) -> int:
        return self.group.world_size

    @property
    def rank(self) -> int:
        return self.group.rank_in_group

    def exchange(self, mine: RankMessage) -> tuple[dict[str, list[StageRelease]], dict[str, str]]:
        """Every rank's releases by request (in rank order) and the failures of all ranks."""
        messages: list[RankMessage | None] = [None] * self.size
        torch.distributed.all_gather_object(messages, mine, group=self.group.cpu_group)
        releases: dict[str, list[StageRelease]] = {}
        failures: dict[str, str] = {}
        for message in messages:
            for req_id, release in message.releases.items():
                releases.setdefault(req_id, []).append(release)
            failures.update(message.failures)
        return releases, failures

    def agree(self, mine: set[str]) -> set[str]:
        """The requests every rank names."""
        sets: list[set[str] | None] = [None] * self.size
        torch.distributed.all_gather_object(sets, mine, group=self.group.cpu_group)
        return set.intersection(*sets)
