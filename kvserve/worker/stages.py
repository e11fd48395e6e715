"""Pipeline parallelism: the message each stage passes down the pipeline after a step, so that the last stage can
report the whole request to the scheduler.

Under `--pipeline-parallel-size N` every stage holds some layers' pages in the SAME vLLM blocks, and only the last
stage's output reaches the scheduler. After each step, stage s receives the stages before it's message (s > 0),
adds its own, and sends it on (s < N - 1): per compacted request its `StageRelease` (page counts, live pages per
block), and the requests whose policy raised on it. The last stage chooses the blocks the request gives back from
all stages' counts (`blocks_to_release`), moves its own pages out of them, and reports; the earlier stages move
theirs when the next schedule names the blocks (`StepPlan.releases`), before that step writes anything.

The message travels on the pipeline group's CPU (gloo) group under its own tag, sent without waiting (the next stage
receives it only after its forward, which needs this stage's activations, sent after this message), and the stages
exchange one per step that ran a forward, so sends and receives always pair up.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch

from kvserve.messages import StageRelease

TAG = 0x6B76  # "kv": apart from vLLM's own point-to-point messages on the same group


@dataclass
class StageMessage:
    releases: dict[str, list[StageRelease]] = field(default_factory=dict)  # req id -> one per stage so far
    failures: dict[str, str] = field(default_factory=dict)  # req id -> why its policy raised


class StageLink:
    """This stage's ends of the link to its neighbours in the pipeline."""

    def __init__(self, group) -> None:
        self.group = group
        self.pending: list[tuple] = []  # (work, buffer) of sends not yet known to be complete

    @property
    def is_last(self) -> bool:
        return self.group.is_last_rank

    def receive(self) -> StageMessage:
        if self.group.is_first_rank:
            return StageMessage()
        source = self.group.rank_in_group - 1
        size = torch.empty(1, dtype=torch.int64)
        torch.distributed.recv(size, group=self.group.cpu_group, group_src=source, tag=TAG)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        torch.distributed.recv(payload, group=self.group.cpu_group, group_src=source, tag=TAG + 1)
        return pickle.loads(payload.numpy().tobytes())

    def send(self, message: StageMessage) -> None:
        for work, _ in self.pending:
            work.wait()
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        destination = self.group.rank_in_group + 1
        self.pending = [
            (torch.distributed.isend(buffer, group=self.group.cpu_group, group_dst=destination, tag=tag), buffer)
            for buffer, tag in ((size, TAG), (payload, TAG + 1))
        ]
