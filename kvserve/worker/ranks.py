"""Tensor parallelism: the ranks of a stage agree on what a step did before any block goes back.

Under `--tensor-parallel-size N` each rank holds H / N KV heads of every layer in the SAME vLLM blocks and evicts
its own heads, and only rank 0's output reaches the engine core. After a step in which the engine core planned a
compaction, the ranks exchange over the tensor-parallel group's CPU (gloo) group, per compacted request, each rank's
`StageRelease` and every rank's failures. Each rank then holds every rank's counts, so each chooses the same blocks
to give back (`blocks_to_release` is a function of them) and moves its own live pages out of them at once; rank 0
reports every rank's counts, and the engine core charges the request the most blocks any rank needs. A checkpoint is
published only when every rank's lists fill whole blocks (`agree`).

The ranks run every step together (vLLM broadcasts each schedule to all of them), and whether a step planned a
compaction is part of that schedule, so the collectives pair up. A step without one exchanges nothing: most decode
steps compact nothing (once per block of new tokens), and an exchange every step made two ranks slower than one on
the decode-heavy benchmark. A policy that fails on another rank in such a step tells rank 0 by a notice
(`FailureNotices`), which rank 0 reads at the end of a later step without waiting for it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch

from kvserve.messages import StageRelease

NOTICE_TAG = 0x4B5653  # the notices' gloo tag ("KVS"), apart from vLLM's own messages on the group
NOTICE_BYTES = 4096  # one notice: its pickled failures, their length, then MAGIC
MAGIC = 0x6B76736572766531  # the notice's last 8 bytes: it has arrived whole
MAX_UNCONFIRMED = 64  # notices sent without waiting for their delivery (a few per failed request)


@dataclass
class RankMessage:
    releases: dict[str, StageRelease] = field(default_factory=dict)  # req id -> this rank's counts
    failures: dict[str, str] = field(default_factory=dict)  # req id -> why its policy raised on this rank


class FailureNotices:
    """Failures that reach rank 0 without an exchange: another rank sends each step's failures to rank 0 as one
    fixed-size point-to-point message and does not wait for it; rank 0 keeps a receive posted from every other rank
    and, at the end of each step, reads the ones that arrived. A notice sent at the end of step t has arrived by the
    end of step t + 1 at the latest in practice, since rank 0 cannot finish step t + 1's forward before the sender
    joins its collectives (vLLM's all-reduces) after sending. gloo's `Work.is_completed()` stays False for a
    point-to-point receive until `wait()` is called (torch 2.13), so arrival is read off the buffer: the sender ends
    every notice with MAGIC, and gloo writes a message's bytes in order."""

    def __init__(self, group) -> None:
        self.group = group
        self._receives: dict[int, tuple[torch.Tensor, object]] = {}
        self._unconfirmed: list[tuple[torch.Tensor, object]] = []
        if group.rank_in_group == 0:
            for peer in range(1, group.world_size):
                self._post(peer)

    def _post(self, peer: int) -> None:
        buffer = torch.zeros(NOTICE_BYTES, dtype=torch.uint8)
        work = torch.distributed.irecv(buffer, group=self.group.cpu_group, tag=NOTICE_TAG, group_src=peer)
        self._receives[peer] = (buffer, work)

    def send(self, failures: dict[str, str]) -> None:
        """Another rank: tell rank 0 of `failures` (nothing is sent for none)."""
        if not failures:
            return
        buffer = torch.zeros(NOTICE_BYTES, dtype=torch.uint8)
        payload = _fitting(failures)
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        buffer[-16:].view(torch.int64)[:] = torch.tensor([len(payload), MAGIC])
        work = torch.distributed.isend(buffer, group=self.group.cpu_group, tag=NOTICE_TAG, group_dst=0)
        self._unconfirmed.append((buffer, work))  # the buffer must live until it is sent
        if len(self._unconfirmed) > MAX_UNCONFIRMED:  # long read by rank 0, which posts a receive again at once
            _, oldest = self._unconfirmed.pop(0)
            oldest.wait()

    def received(self) -> dict[str, str]:
        """Rank 0: the failures in the notices that arrived since the last call."""
        failures: dict[str, str] = {}
        for peer, (buffer, work) in list(self._receives.items()):
            length, magic = buffer[-16:].view(torch.int64).tolist()
            if magic != MAGIC:
                continue
            work.wait()  # done already: its bytes are all here
            failures.update(pickle.loads(buffer[:length].numpy().tobytes()))
            self._post(peer)
        return failures


def _fitting(failures: dict[str, str]) -> bytes:
    """The failures pickled within a notice; overlong reasons are cut (a request id is never cut)."""
    cut = dict(failures)
    limit = NOTICE_BYTES
    while True:
        payload = pickle.dumps(cut)
        if len(payload) <= NOTICE_BYTES - 16:
            return payload
        limit //= 2
        cut = {req_id: why[:limit] for req_id, why in cut.items()}
        if limit < 16:
            raise ValueError(f"kvserve: {len(failures)} failed requests' ids do not fit one notice")


class TensorRanks:
    """This worker's place among the tensor-parallel ranks of its stage."""

    def __init__(self, group) -> None:
        self.group = group  # vLLM's tensor-parallel GroupCoordinator
        self.notices = FailureNotices(group)

    @property
    def size(self) -> int:
        return self.group.world_size

    @property
    def rank(self) -> int:
        return self.group.rank_in_group

    def quiet_step(self, failures: dict[str, str]) -> dict[str, str]:
        """A step in which no compaction was planned: nothing is exchanged. Another rank sends its `failures` to rank
        0; rank 0 gets the failures other ranks sent it since its last step."""
        if self.rank != 0:
            self.notices.send(failures)
            return {}
        return self.notices.received()

    def exchange(self, mine: RankMessage) -> tuple[dict[str, list[StageRelease]], dict[str, str]]:
        """Every rank's releases by request (in rank order) and the failures of all ranks (rank 0's includes the
        notices that arrived before it, so every rank ends the step knowing the same failures)."""
        if self.rank == 0:
            mine.failures.update(self.notices.received())
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
