"""One engine step as the attention backend sees it: where every (request, layer, KV head) list lives in the page
view (`StepPages`), and which evicting requests score, compact or gate in this step (`StepContext`).

The runner hook builds both after vLLM has prepared the step's inputs (`kvserve/engine/runner.py`); the backend reads
them through `current_step()` in each layer's forward; the runner clears them after the forward.

Pseudo-sequences: vLLM's CPU attention op is called with one row per (KV head, request), rows ordered
`h * R + r`, one KV head and G = Hq / Hkv query heads, over the page view. A request that does not evict gets
derived rows: page `(l * NB + b) * H + h` for its vLLM block b, length = vLLM's `seq_len`, so it reads exactly the
slots vLLM wrote (prefix caching included). An evicting request's rows come from its own page lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.engine.pages import PageLayout
from kvserve.engine.plan import Compaction
from kvserve.engine.request_state import RequestState


def layer_index(layer, layout: PageLayout) -> int:
    """The position of an attention layer's cache in this worker's page view, from its model layer (parsed from its
    name once and kept on it): a later pipeline stage starts past 0, a hybrid model pages only some layers."""
    index = getattr(layer, "_kvserve_layer_idx", None)
    if index is None:
        # vLLM is imported where it is used, here and below, so that the scoring path (this module, eviction, pages)
        # imports without it: the kernel tests run that path on a GPU machine that has no vLLM.
        from vllm.model_executor.models.utils import extract_layer_index

        index = layer._kvserve_layer_idx = extract_layer_index(layer.layer_name)
    return layout.local_index(index)


def pages_this_layer(impl, mode: str, kv_sharing_target_layer_name: str | None) -> bool:
    """Whether this attention layer's cache is head pages (read and written by kvserve) or stays vLLM's (a model
    that does not evict; a hybrid model's sliding-window layer). Read at model construction, where vLLM's config of
    the engine being built is current."""
    from vllm.config import get_current_vllm_config
    from vllm.v1.attention.backend import AttentionType

    from kvserve.model_support import eviction_support

    support = eviction_support(get_current_vllm_config().model_config)
    if not support.evicts or impl.sliding_window != -1:
        return False
    # features whose per-query-head or per-sequence parameters the pseudo-sequence call cannot carry
    unsupported = {
        "attention type other than decoder": impl.attn_type != AttentionType.DECODER,
        "ALiBi": impl.alibi_slopes is not None,
        "attention sinks": impl.sinks is not None,
        "quantised KV cache": impl.is_fp8_kv_cache,
        "KV sharing between layers": kv_sharing_target_layer_name is not None,
    }
    refused = [name for name, present in unsupported.items() if present]
    if refused:  # the config reading said this model evicts: it is wrong about this model, so fail loudly
        raise RuntimeError(
            f"kvserve's head pages ({mode}) do not support {', '.join(refused)}, which this model uses although "
            f"kvserve read its config as one that {support.describe()}; run vanilla vLLM (VLLM_PLUGINS without "
            "'kvserve') and report the model"
        )
    return True


@dataclass
class StepPages:
    layout: PageLayout
    pages: torch.Tensor  # the whole KV buffer as [L * NB * H, 1, block_size, 2 * D] pages
    num_reqs: int
    num_tokens: int
    tables: torch.Tensor  # [L, H * R, W] int32 page ids per pseudo row (h * R + r)
    seq_lens: torch.Tensor  # [L, H * R] int32 entries per pseudo row after this step's writes
    query_start_loc: torch.Tensor  # [H * R + 1] int32 (the same for every layer)
    slots: torch.Tensor  # [L, T * H] int64 page-view slot of each (token, head) this step writes, -1: none
    same_lens: bool  # every layer has the same seq_lens: one scheduler metadata serves all layers
    _metadata: dict[int, object] = field(default_factory=dict)

    def metadata(self, layer_idx: int, build) -> object:
        """vLLM's attention work partition for this layer's pseudo rows (it embeds the lengths, so layers whose
        lists differ need their own); `build(seq_lens)` makes one."""
        key = 0 if self.same_lens else layer_idx
        if key not in self._metadata:
            self._metadata[key] = build(self.seq_lens[layer_idx])
        return self._metadata[key]


@dataclass
class RowPlan:
    """One evicting request's slice of the current batch."""

    req_id: str
    state: RequestState
    row: int
    query_start: int
    query_end: int
    logical_len: int  # tokens the request has computed after this step (drives RoPE positions)
    compaction: Compaction | None
    eviction_seconds: float = 0.0  # scoring + compaction time over this step's layers
    failure: str | None = None  # the policy raised: the request fails, the rest of the batch goes on
    # kv_allocation=global: this step's layers waiting for the last one, which ranks them all together
    deferred: list = field(default_factory=list)

    def lengths(self, layer_idx: int) -> torch.Tensor:
        """[H] entries of each of the layer's lists after this step's writes."""
        return torch.from_numpy(self.state.pages.lens[layer_idx])

    def table(self, layer_idx: int) -> torch.Tensor:
        """[H, W] the layer's page lists (page ids into the page view)."""
        return torch.from_numpy(self.state.pages.table[layer_idx])

    def query_positions(self) -> torch.Tensor:
        count = self.query_end - self.query_start
        return torch.arange(self.logical_len - count, self.logical_len)


@dataclass
class StepContext:
    pages: StepPages
    rows: list[RowPlan]

    def compacts(self) -> bool:
        return any(plan.compaction is not None and plan.failure is None for plan in self.rows)

    def pass_rows(self, statistic: str) -> list[RowPlan]:
        """Plans whose policy wants `statistic` (a `PassStatistics` field) from this step's attention: a backend
        that computes attention itself produces it in the same pass."""
        return [
            plan
            for plan in self.rows
            if plan.failure is None and plan.state.gate is None and statistic in plan.state.policy.pass_statistics
        ]

    def failures(self) -> dict[str, str]:
        return {plan.req_id: plan.failure for plan in self.rows if plan.failure is not None}


_current: StepContext | None = None


def set_step(context: StepContext | None) -> None:
    global _current
    _current = context


def current_step() -> StepContext | None:
    return _current
