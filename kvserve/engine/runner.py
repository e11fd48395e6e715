"""Worker-side bookkeeping around vLLM's model runner: separate RoPE positions from cache slots, build the step
context the attention backend reads, and shrink block tables after compaction.

`num_computed_tokens` stays LOGICAL everywhere in vLLM (it drives RoPE positions and token gathering). For a request
whose cache holds fewer entries, we subtract its offset from `seq_lens` and recompute the slot mapping from
`positions - offset`; `positions` itself is left alone.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import numpy as np
import torch
from vllm.utils.math_utils import cdiv

from kvserve.config import KVConfigError, parse_kv_config
from kvserve.engine.gated import pad_layers_to
from kvserve.engine.plan import FAILURES_ATTR, KEPT_ATTR, compactions_of
from kvserve.engine.worker_state import GateRuntime, RequestState, RowPlan, StepContext, current_step, set_step

RECENT_LIMIT = 32


class EvictionBook:
    """Per-runner eviction state, attached to the model runner as `runner.kvserve`."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        # The last few finished requests' states (kept positions per layer, without the window buffers), for
        # introspection: tests and debugging compare what was kept against references.
        self.recent: OrderedDict[str, RequestState] = OrderedDict()
        self.not_evicting: set[str] = set()
        self.pending: dict[str, tuple[int, int]] = {}  # req id -> (keep_tokens, logical_tokens) from the last step
        self.failures: dict[str, str] = {}  # req id -> why its policy failed, until the scheduler hears of it
        self.kept: dict[str, int] = {}  # req id -> entries a ragged compaction kept, until the scheduler hears of it

    def state_for(self, req_id: str, runner) -> RequestState | None:
        if req_id in self.requests:
            return self.requests[req_id]
        req_state = runner.requests.get(req_id)
        sampling_params = getattr(req_state, "sampling_params", None)
        if req_id in self.not_evicting or sampling_params is None:
            return None
        try:
            config = parse_kv_config(sampling_params.extra_args)
        except KVConfigError:
            config = None  # the scheduler logged it and serves the request without eviction
        if config is None or not config.evicts:
            self.not_evicting.add(req_id)
            return None
        state = RequestState(config=config, policy=config.make_policy())
        if config.ragged:
            try:
                state.gate = _gate_runtime(runner, req_state)
            except Exception as error:  # e.g. a gate file that fails its checksum: fail the request, not the engine
                self.failures[req_id] = f"kv_policy {config.policy!r} cannot start: {error}"
                self.not_evicting.add(req_id)
                return None
        self.requests[req_id] = state
        return state

    def forget(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            for layer in state.layers.values():
                layer.window_queries = layer.window_positions = None
            self.recent[req_id] = state
            while len(self.recent) > RECENT_LIMIT:
                self.recent.popitem(last=False)
        self.not_evicting.discard(req_id)
        self.pending.pop(req_id, None)


def _gate_runtime(runner, req_state) -> GateRuntime:
    from kvserve.gates.model import LlamaShape
    from kvserve.gates.registry import load_gates

    # the same reading of the config as the gates' training model (it refuses RoPE variants the gate cannot undo)
    shape = LlamaShape.from_config(runner.model_config.hf_config.to_dict())
    gates = load_gates(runner.model_config.model, shape.num_layers, shape.num_heads * shape.head_dim,
                       shape.num_kv_heads)
    return GateRuntime(gates=gates, rope_theta=shape.rope_theta, prompt_len=req_state.num_prompt_tokens)


def book_of(runner) -> EvictionBook:
    book = getattr(runner, "kvserve", None)
    if book is None:
        book = runner.kvserve = EvictionBook()
    return book


def before_update_states(runner, scheduler_output) -> None:
    """Apply last step's compactions to the worker's view before vLLM appends this step's new blocks."""
    book = book_of(runner)
    for req_id in scheduler_output.finished_req_ids:
        book.forget(req_id)
    for req_id, (keep_tokens, logical_tokens) in book.pending.items():
        state = book.requests.get(req_id)
        req_state = runner.requests.get(req_id)
        if state is None or req_state is None:
            continue
        state.offset = logical_tokens - keep_tokens
        state.compactions += 1
        keep_blocks = cdiv(keep_tokens, runner.cache_config.block_size)
        del req_state.block_ids[0][keep_blocks:]
        row = runner.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            table = runner.input_batch.block_table[0]
            table.block_table.np[row, keep_blocks : table.num_blocks_per_row[row]] = 0
            table.num_blocks_per_row[row] = keep_blocks
    book.pending.clear()
    for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
        if req_id in book.requests:
            book.requests[req_id].reset()


def after_prepare_inputs(runner, scheduler_output, num_scheduled_tokens: np.ndarray) -> None:
    """Shift evicting requests' seq_lens and slot mapping to cache space and publish the step context."""
    book = book_of(runner)
    num_reqs = runner.input_batch.num_reqs
    compactions = compactions_of(scheduler_output)
    offsets = np.zeros(num_reqs, dtype=np.int64)
    rows: list[RowPlan] = []
    query_starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens[:num_reqs])])
    for row, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
        state = book.state_for(req_id, runner)
        if state is None:
            continue
        offsets[row] = state.offset
        logical_len = int(runner.input_batch.num_computed_tokens_cpu[row]) + int(num_scheduled_tokens[row])
        compaction = compactions.get(req_id)
        rows.append(RowPlan(req_id=req_id, state=state, row=row, query_start=int(query_starts[row]),
                            query_end=int(query_starts[row + 1]), cache_len=logical_len - state.offset,
                            compaction=compaction))
        if compaction is not None:
            if compaction.cached_tokens != logical_len - state.offset:
                raise RuntimeError(f"kvserve: scheduler and worker disagree on request {req_id}'s cache length")
            book.pending[req_id] = (compaction.keep_tokens, compaction.logical_tokens)
    if offsets.any():
        total = int(query_starts[num_reqs])
        offsets_t = torch.from_numpy(offsets)
        runner.seq_lens[:num_reqs] -= offsets_t.to(runner.seq_lens.dtype)
        runner.optimistic_seq_lens_cpu[:num_reqs] -= offsets_t.to(runner.optimistic_seq_lens_cpu.dtype)
        per_token = torch.from_numpy(np.repeat(offsets, num_scheduled_tokens[:num_reqs]))
        cache_positions = runner.positions[:total] - per_token.to(runner.positions.dtype)
        runner.input_batch.block_table.compute_slot_mapping(
            num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], cache_positions)
    set_step(StepContext(rows=rows) if rows else None)


def clear_step(runner) -> None:
    step = current_step()
    if step is not None:
        step.record_times()
        failures = step.failures()
        book = book_of(runner)
        book.failures.update(failures)
        for req_id in failures:  # its cache was not compacted: the scheduler frees it whole when it fails it
            book.pending.pop(req_id, None)
        for plan in step.rows:  # ragged compactions: the count is known only now, after every layer ran
            if plan.kept_tokens is not None and plan.failure is None:
                pad_layers_to(plan.state, plan.kept_tokens)
                book.pending[plan.req_id] = (plan.kept_tokens, plan.compaction.logical_tokens)
                book.kept[plan.req_id] = plan.kept_tokens
    set_step(None)


def attach_failures(runner, output):
    """Hand failed requests, and ragged compactions' kept counts, to the scheduler on the step's output (it travels
    to the engine core pickled)."""
    book = book_of(runner)
    if output is None or not (book.failures or book.kept):
        return output
    output = copy.copy(output)  # never mark a shared constant such as EMPTY_MODEL_RUNNER_OUTPUT
    setattr(output, FAILURES_ATTR, dict(book.failures))
    setattr(output, KEPT_ATTR, dict(book.kept))
    book.failures.clear()
    book.kept.clear()
    return output
