"""The worker's hooks around vLLM's model runner (points `update_states`, `prepare_inputs`, `execute_model` and
`sample_tokens` of `kvserve/vllm/points.py`): they read vLLM's runner and batch, and hand them to the worker's
requests (`kvserve/worker/requests.py`), which keep each evicting request's page lists in step with the blocks the
engine core gave it.

1. `before_update_states`: finished requests are forgotten, preempted ones restarted, and the blocks requests gave
   back last step leave vLLM's view of them, before vLLM appends this step's blocks.
2. `after_prepare_inputs`: new evicting requests are admitted (the step plan carries their settings), every evicting
   request's lists take the step's tokens, and the step's page tables (`StepPages`) are published for the attention
   layers (`kvserve/vllm/attention.py`), which write, read, score and compact through them.
3. `after_forward`: compacted requests give back the blocks their lists no longer need; `report_step` puts what
   the engine core must hear (page reports, failures) on the step's output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from kvserve.metrics import set_engine
from kvserve.model_support import eviction_support
from kvserve.vllm.carriers import plan_of, with_report
from kvserve.vllm.model import (
    caches_by_layer,
    layer_numbers,
    mark_drafter_layers,
    paged_group,
    pipeline_group,
    rotary_tables,
    tensor_group,
)
from kvserve.worker.pages import check_cache_contract, page_view
from kvserve.worker.ranks import TensorRanks
from kvserve.worker.request import GateRuntime
from kvserve.worker.requests import BatchRow, WorkerRequests
from kvserve.worker.stages import StageLink
from kvserve.worker.step import StepContext, build_step_pages, current_step, set_step

_UNSET = object()


def requests_of(runner) -> WorkerRequests | None:
    """The runner's evicting requests (`runner.kvserve`), made once the KV cache exists: the paged group's cache
    is checked against the page contract and viewed as pages. None when this model does not evict
    (`kvserve/model_support.py`): every layer stays vLLM's."""
    book = getattr(runner, "kvserve", _UNSET)
    if book is _UNSET:
        book = runner.kvserve = _attach(runner)
    return book


def _attach(runner) -> WorkerRequests | None:
    set_engine(runner.vllm_config.parallel_config.data_parallel_index)  # the engine label of what this worker counts
    support = eviction_support(runner.model_config)
    group = paged_group(runner.kv_cache_config, support)
    if group is None:
        return None
    mark_drafter_layers(runner, support.num_layers)
    model_layers = layer_numbers(runner.kv_cache_config.kv_cache_groups[group].layer_names, support.num_layers)
    caches = caches_by_layer(runner, support.num_layers)
    layout = check_cache_contract([caches[index] for index in model_layers])
    ranks = tensor_group()
    rank = 0 if ranks is None else ranks.rank_in_group
    layout = dataclasses.replace(
        layout,
        first_layer=support.paged_layers.index(model_layers[0]),  # > 0 on a later pipeline stage
        model_layers=len(support.paged_layers),
        model_layer_ids=model_layers,
        # vLLM gives tensor-parallel rank r the r-th equal share of the KV heads (more ranks than heads: refused)
        first_head=rank * layout.num_heads,
        model_heads=runner.model_config.get_total_num_kv_heads(),
    )
    pages = page_view([caches[index] for index in model_layers], layout)
    link_group = pipeline_group()
    book = WorkerRequests(
        layout,
        pages,
        rotary=rotary_tables(runner.get_model(), model_layers, pages.device),
        model=Path(str(runner.model_config.model).rstrip("/")).name,
        link=None if link_group is None else StageLink(link_group),
        group=group,
        ranks=None if ranks is None else TensorRanks(ranks),
    )
    return book


def before_update_states(runner, scheduler_output) -> None:
    """Before vLLM appends this step's blocks: the worker's requests begin the step, and the blocks they gave back
    leave vLLM's view of them (its request state and its batch's block table)."""
    book = requests_of(runner)
    if book is None:
        return
    restarted = [
        *scheduler_output.scheduled_cached_reqs.resumed_req_ids,
        *(request.req_id for request in scheduler_output.scheduled_new_reqs),
    ]
    book.begin_step(plan_of(scheduler_output), set(scheduler_output.finished_req_ids), restarted)
    for req_id, released in book.released_blocks().items():
        req_state = runner.requests.get(req_id)
        if req_state is None:
            continue
        gone = set(released)
        kept = [block for block in req_state.block_ids[book.group] if block not in gone]
        req_state.block_ids[book.group][:] = kept
        row = runner.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            table = runner.input_batch.block_table[book.group]
            table.block_table.np[row, : table.num_blocks_per_row[row]] = 0
            table.block_table.np[row, : len(kept)] = kept
            table.num_blocks_per_row[row] = len(kept)


def after_prepare_inputs(runner, scheduler_output, num_scheduled_tokens: np.ndarray) -> None:
    """Admit the step's new evicting requests, append this step's tokens to the evicting requests' page lists and
    publish the step's page tables."""
    book = requests_of(runner)
    if book is None:
        return
    plan = plan_of(scheduler_output)
    book.admit(plan, lambda req_id: _gate_runtime(runner, req_id))
    num_reqs = runner.input_batch.num_reqs
    query_starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens[:num_reqs])])
    drafts = scheduler_output.scheduled_spec_decode_tokens  # speculative decoding: each row's draft tokens
    batch = [
        BatchRow(
            req_id=req_id,
            row=row,
            block_ids=runner.requests[req_id].block_ids[book.group],
            computed=int(runner.input_batch.num_computed_tokens_cpu[row]),
            num_new=int(num_scheduled_tokens[row]),
            query_start=int(query_starts[row]),
            drafts=len(drafts.get(req_id, ())),
        )
        for row, req_id in enumerate(runner.input_batch.req_ids[:num_reqs])
        if req_id in book.requests
    ]
    rows, appended = book.step_rows(plan, batch)
    block_table = runner.input_batch.block_table[book.group]
    vllm_width = max(int(block_table.num_blocks_per_row[:num_reqs].max(initial=0)), 1)
    num_tokens = int(query_starts[num_reqs])
    pages = build_step_pages(
        book.layout,
        book.pages,
        rows,
        appended,
        vllm_blocks=torch.from_numpy(block_table.block_table.np[:num_reqs, :vllm_width]).long(),
        seq_lens=runner.seq_lens[:num_reqs],
        slot_mapping=block_table.slot_mapping.gpu[:num_tokens].long(),
        query_start_loc=runner.query_start_loc.cpu[: num_reqs + 1],
    )
    set_step(StepContext(pages=pages, rows=rows))


def _gate_runtime(runner, req_id: str) -> GateRuntime:
    from kvserve.gates.registry import load_gates
    from kvserve.gates.shape import LlamaShape

    # the gates' training model's reading of the config: it refuses RoPE variants (the gates learned plain RoPE)
    shape = LlamaShape.from_config(runner.model_config.hf_config.to_dict())
    gates = load_gates(
        runner.model_config.model, shape.num_layers, shape.num_heads * shape.head_dim, shape.num_kv_heads
    )
    return GateRuntime(gates=gates, prompt_len=runner.requests[req_id].num_prompt_tokens)


def drop_step() -> None:
    """The forward raised: forget the step (the engine reports the error)."""
    set_step(None)


def after_forward(runner) -> None:
    """After the forward: the worker's requests end the step (compacted ones give back blocks)."""
    step = current_step()
    set_step(None)
    if step is None:  # no forward ran
        return
    requests_of(runner).end_step(step)


def report_step(runner, output):
    """Hand failed requests, and compacted requests' page reports, to the engine core on the step's output."""
    book = requests_of(runner)
    if book is None or output is None:
        return output
    return with_report(output, book.report())
