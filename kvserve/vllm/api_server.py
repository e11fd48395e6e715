"""kvserve's patches on vLLM's front end (points `input_validation` .. `shutdown` of `kvserve/vllm/points.py`).

- `input_validation` (every process: the front end of offline `vllm.LLM` runs in the user's): a request's `kv_*`
  settings are validated at vLLM's `InputProcessor._validate_params`, the one gate every request passes (an invalid
  one gets vLLM's validation error, HTTP 400 naming the field), and the result is written into its sampling
  parameters (`kvserve.config.SETTINGS_KEY`), which is all the engine core reads of them.
- `generate`, `process_outputs` (API server): record each engine request's running evicted-token count (it rides on
  the engine's outputs) in the HTTP request's tally, which the middleware writes into the response's usage block,
  and take it off the outputs served (`kvserve/server/evicted.py`).
- `http_middleware` (API server): add kvserve's header middleware INSIDE vLLM's own, so `--api-key` authentication
  (and CORS) run before any `x-kv-*` header or body is read.
- `serve_http`, `shutdown` (API server): when the engine dies (a crash nobody asked for, not a SIGTERM), vLLM fails
  `/health` and stops the HTTP server, but the process then exits 0, so a supervisor's restart-on-failure policy
  would not restart it. kvserve makes that exit status 1.
"""

from __future__ import annotations

import functools
import sys

ENGINE_DEATH_EXIT_STATUS = 1


def apply() -> None:
    import vllm

    from kvserve.vllm import points

    _patch_input_validation()
    # Only the API server process has imported the app builder (at start-up, before plugins load); engine-core and
    # worker processes skip these patches instead of importing FastAPI's world.
    app_module = sys.modules.get("vllm.entrypoints.launchers.app")
    if app_module is None:
        return
    points.check(points.group("api"), vllm.__version__)
    _log_policy_defaults()
    _patch_evicted_tally()
    _patch_middleware(app_module)
    _patch_exit_status(sys.modules.get("vllm.entrypoints.launchers.api_server.entry"))


def _log_policy_defaults() -> None:
    """What a request naming only a policy gets, per policy, from this server's defaults (`kvserve serve`'s, or none
    under `vllm serve`): the same lines whichever way the server was started."""
    from kvserve.config import env_defaults
    from kvserve.effective_defaults import effective_defaults

    defaults = env_defaults()
    print(f"kvserve: eviction defaults {defaults}; each policy's, when a request names it:", file=sys.stderr)
    for line in effective_defaults(defaults):
        print(f"kvserve:   {line}", file=sys.stderr, flush=True)


def _patch_input_validation() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from kvserve.config import SETTINGS_KEY
    from kvserve.errors import InvalidSetting
    from kvserve.model_support import served_settings
    from kvserve.vllm.model import served_engine

    original = InputProcessor._validate_params

    @functools.wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        if isinstance(params, SamplingParams):
            try:
                settings = served_settings(params.extra_args, served_engine(self.vllm_config))
            except InvalidSetting as exc:
                raise VLLMValidationError(str(exc), parameter=exc.field) from exc
            # over anything a request brought under this key: the engine core trusts what it reads there
            params.extra_args = {**(params.extra_args or {}), SETTINGS_KEY: settings.to_wire()}
        return original(self, params, *args, **kwargs)

    InputProcessor._validate_params = _validate_params


def _patch_evicted_tally() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    from kvserve.server.evicted import record_engine_outputs, strip_kvserve_keys, tally_for

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

    AsyncLLM.generate = _generate
    OutputProcessor.process_outputs = _process_outputs


def _patch_middleware(app_module) -> None:
    from kvserve.server.middleware import KVHeadersMiddleware
    from kvserve.vllm.model import served_engine_of_app

    init_middleware = app_module.init_entrypoints_middleware

    @functools.wraps(init_middleware)
    def init_entrypoints_middleware(args, app, *rest, **kwargs):
        # Starlette: added first = innermost, so vLLM's run before it
        app.add_middleware(KVHeadersMiddleware, served=served_engine_of_app)
        return init_middleware(args, app, *rest, **kwargs)

    app_module.init_entrypoints_middleware = init_entrypoints_middleware


def _patch_exit_status(entry_module) -> None:
    if entry_module is None:  # another launcher than the OpenAI API server: nothing to do
        return
    from vllm.v1.engine.async_llm import AsyncLLM

    shutdown = AsyncLLM.shutdown
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

    AsyncLLM.shutdown = _shutdown
    entry_module.serve_http = _serve_http
