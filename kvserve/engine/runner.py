"""Worker-side hooks around vLLM's model runner: keep evicting requests' page lists in step with the blocks the
scheduler gave them, build each step's page tables for the attention backend, and give emptied blocks back.

`num_computed_tokens` stays LOGICAL everywhere in vLLM (it drives RoPE positions and token gathering); where each
(layer, KV head)'s entries live is kvserve's business alone: the backend writes and reads through `StepPages` and
ignores vLLM's slot mapping and block table for attention.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import torch
from vllm.model_executor.models.utils import extract_layer_index

from kvserve.config import parse_kv_config
from kvserve.engine.checkpoints import CheckpointLists, lists_of, resume_from
from kvserve.engine.eviction import record_times
from kvserve.engine.pages import (
    HeadPages,
    PageLayout,
    blocks_to_release,
    check_cache_contract,
    copy_pages,
    page_view,
)
from kvserve.engine.plan import (
    FAILURES_ATTR,
    PAGES_ATTR,
    CheckpointId,
    PageReport,
    StagePages,
    StageRelease,
    adoptions_of,
    compactions_of,
    dropped_checkpoints_of,
    releases_of,
)
from kvserve.engine.request_state import GateRuntime, RequestState
from kvserve.engine.stages import StageLink, pipeline_group
from kvserve.engine.step import RowPlan, StepContext, StepPages, current_step, set_step
from kvserve.errors import InvalidSetting
from kvserve.model_support import eviction_support, paged_group
from kvserve.policies.rotary import Rotary


class EvictionBook:
    """Per-runner eviction state, attached to the model runner as `runner.kvserve`."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        self.not_evicting: set[str] = set()
        self.released: dict[str, list[int]] = {}  # req id -> vLLM blocks given back last step, to drop from vLLM's view
        self.failures: dict[str, str] = {}  # req id -> why its policy failed, until the scheduler hears of it
        self.reports: dict[str, PageReport] = {}  # req id -> its lists after a compaction, until the scheduler hears
        self.layout: PageLayout | None = None
        self.pages: torch.Tensor | None = None  # the page view of the whole KV buffer
        self.link: StageLink | None = None  # pipeline parallelism: this stage's link to its neighbours
        self.pipeline_checked = False
        self.vanilla = False  # this model cannot evict: kvserve leaves every step to vLLM
        self.group = 0  # the KV-cache group whose blocks hold head pages (a hybrid model's full-attention layers)
        self.rotary: dict[int, Rotary] = {}  # each paged layer's RoPE table, by page-view index
        self.checkpoints: dict[CheckpointId, CheckpointLists] = {}  # published checkpoints' lists (kv_checkpoint)

    def pipeline_link(self) -> StageLink | None:
        if not self.pipeline_checked:
            group = pipeline_group()
            self.link = None if group is None else StageLink(group)
            self.pipeline_checked = True
        return self.link

    def attach_cache(self, runner) -> bool:
        """Check the paged group's KV cache against the page contract (once, at the first step) and view it as
        pages. False when this model does not evict (`kvserve/model_support.py`): every layer stays vLLM's."""
        if self.layout is None and not self.vanilla:
            support = eviction_support(runner.model_config)
            group = paged_group(runner.kv_cache_config, support)
            if group is None:
                self.vanilla = True
                return False
            self.group = group
            names = sorted(runner.kv_cache_config.kv_cache_groups[group].layer_names, key=extract_layer_index)
            caches = _caches_by_layer(runner)
            model_layers = tuple(extract_layer_index(name) for name in names)
            layout = check_cache_contract([caches[index] for index in model_layers])
            self.layout = dataclasses.replace(
                layout,
                first_layer=support.paged_layers.index(model_layers[0]),  # > 0 on a later pipeline stage
                model_layers=len(support.paged_layers),
                model_layer_ids=model_layers,
            )
            self.pages = page_view([caches[index] for index in model_layers], self.layout)
            self.rotary = _rotary_tables(runner.get_model(), model_layers, self.pages.device)
        return not self.vanilla

    def state_for(self, req_id: str, runner) -> RequestState | None:
        if req_id in self.requests:
            return self.requests[req_id]
        req_state = runner.requests.get(req_id)
        sampling_params = getattr(req_state, "sampling_params", None)
        if req_id in self.not_evicting or sampling_params is None:
            return None
        try:
            config = parse_kv_config(sampling_params.extra_args)
        except InvalidSetting:
            config = None  # the scheduler logged it and serves the request without eviction
        if config is None or not config.evicts:
            self.not_evicting.add(req_id)
            return None
        state = RequestState(
            config=config,
            policy=config.make_policy(),
            pages=HeadPages(self.layout),
            rotary=self.rotary,
            model=Path(str(runner.model_config.model).rstrip("/")).name,
        )
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
        self.requests.pop(req_id, None)
        self.not_evicting.discard(req_id)
        self.released.pop(req_id, None)


def _caches_by_layer(runner) -> dict[int, torch.Tensor]:
    """This worker's KV caches by model layer (vLLM lists `runner.kv_caches` in layer order over every group)."""
    groups = runner.kv_cache_config.kv_cache_groups
    names = sorted((name for group in groups for name in group.layer_names), key=extract_layer_index)
    if len(names) != len(runner.kv_caches):
        raise RuntimeError(f"kvserve: {len(names)} attention layers but {len(runner.kv_caches)} KV caches")
    return {extract_layer_index(name): cache for name, cache in zip(names, runner.kv_caches, strict=True)}


def _rotary_tables(model: torch.nn.Module, model_layers: tuple[int, ...], device: torch.device) -> dict[int, Rotary]:
    """The RoPE table of each paged layer (by page-view index), read from the model's own rotary modules, so that a
    scaled variant (YaRN, Llama 3, ...) arrives as the model applies it. A layer's module is the one named inside it
    (`model.layers.5.self_attn.rotary_emb`); a model with one rotary module outside its layers shares it. A layer
    with neither gets none (a policy that needs it then fails with the reason)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    by_layer: dict[int, RotaryEmbeddingBase] = {}
    shared: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):  # get_rope hands one module to many layers
        if isinstance(module, RotaryEmbeddingBase):
            shared.add(id(module))
            try:
                by_layer.setdefault(extract_layer_index(name), module)
            except AssertionError:  # no layer number in the name: a model-level module
                by_layer.setdefault(-1, module)
    tables = {}
    for index, model_layer in enumerate(model_layers):
        module = by_layer.get(model_layer, by_layer.get(-1) if len(shared) == 1 else None)
        if module is None:
            continue
        try:  # vLLM's float32 table, before it is cast to the model's dtype
            table = module._compute_cos_sin_cache()
        except TypeError:  # a variant whose table takes arguments: the one the model holds
            table = module.cos_sin_cache
        cos, sin = table.float().to(device).chunk(2, dim=-1)
        tables[index] = Rotary(cos.contiguous(), sin.contiguous(), neox=bool(module.is_neox_style))
    return tables


def _gate_runtime(runner, req_state) -> GateRuntime:
    from kvserve.gates.model import LlamaShape
    from kvserve.gates.registry import load_gates

    # the gates' training model's reading of the config: it refuses RoPE variants (the gates learned plain RoPE)
    shape = LlamaShape.from_config(runner.model_config.hf_config.to_dict())
    gates = load_gates(
        runner.model_config.model, shape.num_layers, shape.num_heads * shape.head_dim, shape.num_kv_heads
    )
    return GateRuntime(gates=gates, prompt_len=req_state.num_prompt_tokens)


def book_of(runner) -> EvictionBook:
    book = getattr(runner, "kvserve", None)
    if book is None:
        book = runner.kvserve = EvictionBook()
    return book


def before_update_states(runner, scheduler_output) -> None:
    """Drop the blocks given back last step from vLLM's view of each request, before vLLM appends this step's (on an
    earlier pipeline stage, first move the live pages out of the blocks the last stage gave back)."""
    book = book_of(runner)
    for req_id in scheduler_output.finished_req_ids:
        book.forget(req_id)
    for checkpoint in dropped_checkpoints_of(scheduler_output):
        book.checkpoints.pop(checkpoint, None)
    link = book.pipeline_link()
    if link is not None and not link.is_last:
        for req_id, released in releases_of(scheduler_output).items():
            state = book.requests.get(req_id)
            if state is not None:
                _move_pages(book, state.pages.release(released))
                book.released[req_id] = list(released)
    for req_id, released in book.released.items():
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
    book.released.clear()
    restarted = [
        *scheduler_output.scheduled_cached_reqs.resumed_req_ids,
        *(request.req_id for request in scheduler_output.scheduled_new_reqs),
    ]
    for req_id in restarted:  # after a preemption the request recomputes into fresh blocks
        if req_id in book.requests:
            book.requests[req_id].reset()


def after_prepare_inputs(runner, scheduler_output, num_scheduled_tokens: np.ndarray) -> None:
    """Append this step's tokens to the evicting requests' page lists and publish the step's page tables."""
    book = book_of(runner)
    if not book.attach_cache(runner):
        return
    num_reqs = runner.input_batch.num_reqs
    compactions = compactions_of(scheduler_output)
    adoptions = adoptions_of(scheduler_output)
    query_starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens[:num_reqs])])
    rows: list[RowPlan] = []
    appended: dict[int, np.ndarray] = {}  # batch row -> slots [L, H, q] of its new entries
    for row, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
        state = book.state_for(req_id, runner)
        if state is None:
            continue
        block_ids = runner.requests[req_id].block_ids[book.group]
        computed = int(runner.input_batch.num_computed_tokens_cpu[row])
        if req_id in adoptions:  # its first step resumes from a published checkpoint
            resume_from(state, book.checkpoints[adoptions[req_id]], block_ids)
        elif computed and not state.pages.blocks:  # its first step starts from a prefix-cache hit
            state.pages.adopt_prefix(block_ids, computed)
        _take_new_blocks(state.pages, block_ids, req_id)
        appended[row] = state.pages.append(int(num_scheduled_tokens[row]))
        compaction = compactions.get(req_id)
        if compaction is not None:  # the blocks the compaction must not write (none: it may write all it holds)
            state.pages.protect(compaction.protected_blocks)
        logical_len = computed + int(num_scheduled_tokens[row])
        if compaction is not None and compaction.cached_tokens != int(state.pages.lens.max()):
            raise RuntimeError(f"kvserve: scheduler and worker disagree on request {req_id}'s cache length")
        rows.append(
            RowPlan(
                req_id=req_id,
                state=state,
                row=row,
                query_start=int(query_starts[row]),
                query_end=int(query_starts[row + 1]),
                logical_len=logical_len,
                compaction=compaction,
            )
        )
    pages = _step_pages(runner, book, num_reqs, int(query_starts[num_reqs]), rows, appended)
    set_step(StepContext(pages=pages, rows=rows))


def _take_new_blocks(pages: HeadPages, block_ids: list[int], req_id: str) -> None:
    held = len(pages.blocks)
    if block_ids[:held] != pages.blocks:
        raise RuntimeError(f"kvserve: request {req_id}'s blocks in vLLM and in its page lists differ")
    if len(block_ids) > held:
        pages.add_blocks(block_ids[held:])


def _step_pages(
    runner, book: EvictionBook, num_reqs: int, num_tokens: int, rows: list[RowPlan], appended: dict[int, np.ndarray]
) -> StepPages:
    """Every (layer, head, request)'s page list as pseudo rows `h * R + r`: derived from vLLM's block table for
    requests that do not evict, from their own lists for those that do."""
    layout = book.layout
    num_layers, num_heads, bs = layout.num_layers, layout.num_heads, layout.block_size
    block_table = runner.input_batch.block_table[book.group]
    vllm_width = max(int(block_table.num_blocks_per_row[:num_reqs].max(initial=0)), 1)
    width = max([vllm_width] + [plan.state.pages.table.shape[2] for plan in rows])
    blocks = torch.from_numpy(block_table.block_table.np[:num_reqs, :vllm_width]).long()
    heads = torch.arange(num_heads)
    layer_base = torch.arange(num_layers) * layout.num_blocks * num_heads
    tables = torch.zeros(num_layers, num_heads, num_reqs, width, dtype=torch.long)
    tables[..., :vllm_width] = (
        blocks[None, None] * num_heads + heads[None, :, None, None] + layer_base[:, None, None, None]
    )
    seq_lens = runner.seq_lens[:num_reqs].to(torch.int32).repeat(num_layers, num_heads, 1)  # [L, H, R]
    slot_mapping = block_table.slot_mapping.gpu[:num_tokens].long()
    page_slots = ((slot_mapping // bs)[:, None] * num_heads + heads[None, :]) * bs + (slot_mapping % bs)[:, None]
    slots = page_slots[None] + layer_base[:, None, None] * bs  # [L, T, H]
    slots[:, slot_mapping < 0] = -1
    for plan in rows:
        lists = plan.state.pages
        tables[:, :, plan.row] = 0
        tables[:, :, plan.row, : lists.table.shape[2]] = torch.from_numpy(lists.table)
        seq_lens[:, :, plan.row] = torch.from_numpy(lists.lens)
        slots[:, plan.query_start : plan.query_end] = torch.from_numpy(appended[plan.row]).transpose(1, 2)
    query_start_loc = runner.query_start_loc.cpu[: num_reqs + 1]
    starts = (query_start_loc[:-1][None, :] + heads[:, None] * num_tokens).reshape(-1)
    pseudo_starts = torch.cat([starts, torch.tensor([num_heads * num_tokens])]).to(torch.int32)
    seq_lens = seq_lens.reshape(num_layers, -1)
    return StepPages(
        layout=layout,
        pages=book.pages,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        tables=tables.reshape(num_layers, num_heads * num_reqs, width).to(torch.int32),
        seq_lens=seq_lens,
        query_start_loc=pseudo_starts,
        slots=slots.reshape(num_layers, -1).contiguous(),
        same_lens=not rows or bool((seq_lens == seq_lens[0]).all()),
    )


def drop_step() -> None:
    """The forward raised: forget the step (the engine reports the error)."""
    set_step(None)


def clear_step(runner) -> None:
    """After the forward: requests whose policy raised go to the scheduler; those that compacted give back the
    blocks their lists no longer need (moving the few live pages out of the emptiest blocks first). Under pipeline
    parallelism the stages first pass their counts down the pipeline (`kvserve/engine/stages.py`)."""
    step = current_step()
    set_step(None)
    if step is None:  # no forward ran
        return
    book = book_of(runner)
    if step.rows:
        record_times(step)
        book.failures.update(step.failures())
    compacted = [plan for plan in step.rows if plan.compaction is not None and plan.failure is None]
    link = book.pipeline_link()
    if link is None:
        for plan in compacted:
            moves, released = plan.state.pages.release_blocks()
            _move_pages(book, moves)
            _release_and_report(book, plan, [plan.state.pages.stage_pages()], released)
            if plan.compaction.checkpoint is not None:
                _publish_checkpoint(book, plan)
        return
    message = link.receive()
    for plan in compacted:
        lists = plan.state.pages
        message.releases.setdefault(plan.req_id, []).append(
            StageRelease(
                pages=lists.stage_pages(),
                block_ids=tuple(lists.blocks),
                live_pages=tuple(int(n) for n in lists.live_pages()),
            )
        )
    if not link.is_last:
        message.failures.update(book.failures)  # only the last stage's output reaches the scheduler
        book.failures.clear()
        link.send(message)
        for plan in compacted:
            _mark_compacted(plan)
        return
    book.failures.update(message.failures)
    for plan in compacted:
        stages = message.releases[plan.req_id]
        if plan.req_id in book.failures or len(stages) != link.group.world_size:
            continue  # it failed on some stage: the scheduler frees all its blocks
        if any(stage.block_ids != stages[-1].block_ids for stage in stages):
            raise RuntimeError(f"kvserve: pipeline stages disagree on request {plan.req_id}'s blocks")
        released = blocks_to_release(
            list(stages[-1].block_ids),
            [(stage.pages.pages, stage.pages.pages_per_block, stage.live_pages) for stage in stages],
            plan.state.pages.protected_ids(),
        )
        lists = plan.state.pages
        _move_pages(book, lists.release(released))
        _release_and_report(book, plan, [stage.pages for stage in stages], released)


def _publish_checkpoint(book: EvictionBook, plan: RowPlan) -> None:
    """The step ended at a prompt checkpoint: keep a copy of the lists if they fill whole blocks, and name their
    blocks in the report; the scheduler gives those blocks the checkpoint's hashes. The request itself must not write
    them any more: they are protected from now on."""
    lists = lists_of(plan.state)
    if lists is None:
        return
    book.checkpoints[(plan.compaction.checkpoint, lists.blocks)] = lists
    plan.state.pages.protected[:] = True
    book.reports[plan.req_id] = dataclasses.replace(book.reports[plan.req_id], checkpoint_blocks=lists.blocks)


def _move_pages(book: EvictionBook, moves: list[tuple[int, int]]) -> None:
    copy_pages(book.pages, moves)


def _mark_compacted(plan: RowPlan) -> None:
    plan.state.since = plan.logical_len  # entries appended after this compaction have positions from here on
    plan.state.compactions += 1


def _release_and_report(book: EvictionBook, plan: RowPlan, stages: list[StagePages], released: list[int]) -> None:
    _mark_compacted(plan)
    book.released[plan.req_id] = released
    book.reports[plan.req_id] = PageReport(
        logical_tokens=plan.logical_len, stages=tuple(stages), released_block_ids=tuple(released)
    )


def attach_failures(runner, output):
    """Hand failed requests, and compacted requests' page reports, to the scheduler on the step's output (it
    travels to the engine core pickled)."""
    book = book_of(runner)
    if output is None or not (book.failures or book.reports):
        return output
    output = copy.copy(output)  # never mark a shared constant such as EMPTY_MODEL_RUNNER_OUTPUT
    setattr(output, FAILURES_ATTR, dict(book.failures))
    setattr(output, PAGES_ATTR, dict(book.reports))
    book.failures.clear()
    book.reports.clear()
    return output
