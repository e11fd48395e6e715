"""The process `kvserve serve` becomes: vLLM's OpenAI API server, started through the entry point vLLM documents
(`vllm serve`'s command, `vllm.entrypoints.cli.serve`), with the model resolved and kvserve's checks run first.

vLLM's parser takes the model as `--model` or as a positional `model_tag` anywhere among the flags (as `vllm serve`
does); its own launcher would let a default `--model` win over that positional and serve another model without a
word. Here the positional and `--model` are one setting: a model given either way is served, two different ones are
refused, and none means kvserve's default model.
"""

from __future__ import annotations

import sys

# vLLM's documented command line, `vllm serve` (the module of vLLM's `vllm` console script): what kvserve runs for
# vLLM's own help and a vanilla server; vLLM 0.32 deprecates `python -m vllm.entrypoints.openai.api_server`
VLLM_SERVE = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def resolve_model(positional: str | None, flag: str | None) -> str | None:
    """The model to serve from the positional `MODEL` and `--model` (None: neither, serve the default model)."""
    if positional is not None and flag is not None and positional != flag:
        raise SystemExit(f"kvserve: two models given, {positional!r} and --model {flag!r}: give one")
    return positional if positional is not None else flag


def _gave_flag(argv: list[str], name: str) -> bool:
    return any(arg == name or arg.startswith(name + "=") for arg in argv)


def parse_serve_args(argv: list[str]):
    """vLLM's server arguments from `argv`, with `args.model` the model to serve (see the module's docstring)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser(description="kvserve: vLLM's OpenAI API server")).parse_args(argv)
    model = resolve_model(args.model_tag, args.model if _gave_flag(argv, "--model") else None)
    if model is None:
        from kvserve.model import DEFAULT_MODEL_NAME, ensure_default_model

        model = str(ensure_default_model())
        if args.served_model_name is None:  # clients name it, not the cache folder it lives in
            args.served_model_name = [DEFAULT_MODEL_NAME]
    args.model, args.model_tag = model, None
    return args


def refuse_where_kvserve_cannot_evict() -> None:
    """`kvserve serve` asks for eviction: where kvserve's plugin would stay inactive (another vLLM release, a platform
    other than the CPU, a vLLM function that moved), it exits saying why instead of serving without it."""
    from kvserve.vllm.patches import inactive_reason

    reason = inactive_reason()
    if reason is not None:
        raise SystemExit(
            f"kvserve serve: eviction is not available here, so kvserve does not start: {reason}. vLLM itself still "
            "serves (`vllm serve`: kvserve's plugin stays inactive)."
        )


def refuse_ray_where_vllm_cannot_run_it(args) -> None:
    """vLLM's Ray executor needs a platform that names its Ray device; vLLM's CPU build names none, and its engine
    failed deep in start-up ("current platform cpu does not support ray"). kvserve says so before starting it."""
    from vllm.platforms import current_platform

    for flag, backend in (
        ("--distributed-executor-backend", getattr(args, "distributed_executor_backend", None)),
        ("--data-parallel-backend", getattr(args, "data_parallel_backend", None)),
    ):
        if backend == "ray" and not current_platform.ray_device_key:
            raise SystemExit(
                f"kvserve serve: {flag} ray: vLLM's {current_platform.device_name} build cannot run Ray workers (its "
                f"platform names no Ray device: 'current platform {current_platform.device_name} does not support "
                "ray'). Across machines, use vLLM's own multiprocessing executor: --nnodes N --node-rank R "
                "--master-addr HEAD on every node, --headless on all but the head node (docs/guide/deployment.md, "
                "Scale-out)."
            )


def refuse_several_api_servers(args) -> None:
    """`kvserve serve` runs vLLM's API server in this one process (whose middleware keeps which prefixes it
    compressed, and pins sessions to engines); vLLM's several-API-server launcher is not what it starts, so a count
    above one is refused rather than ignored. (`vllm serve` with the plugin may still run several.)"""
    count = getattr(args, "api_server_count", None)
    if count is not None and count > 1:
        raise SystemExit(
            f"kvserve serve: --api-server-count {count}: kvserve serves through one API server process; its "
            "--data-parallel-size engines are balanced there. Leave --api-server-count out (or 1)."
        )


def refuse_other_frontends(args) -> None:
    """`vllm serve` may serve through another front end than its Python API server (gRPC, vLLM's Rust front end, a
    supervisor of one server per data-parallel rank), none of which runs kvserve's middleware: refused, named."""
    import vllm.envs as envs

    for given, what in (
        (getattr(args, "grpc", False), "--grpc (vLLM's gRPC server)"),
        (getattr(args, "data_parallel_multi_port_external_lb", False), "--data-parallel-multi-port-external-lb"),
        (envs.VLLM_USE_RUST_FRONTEND, "VLLM_USE_RUST_FRONTEND (vLLM's Rust front end)"),
    ):
        if given:
            raise SystemExit(
                f"kvserve serve: {what}: kvserve serves through vLLM's Python API server, where its middleware "
                "validates and routes requests; leave it out."
            )


def main(argv: list[str] | None = None) -> None:
    refuse_where_kvserve_cannot_evict()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()  # as `vllm`'s own main does before any subcommand
    args = parse_serve_args(sys.argv[1:] if argv is None else argv)
    from kvserve import REQUIRED_VLLM_VERSION, __version__

    print(f"kvserve {__version__} (vLLM {REQUIRED_VLLM_VERSION}): serving {args.model}", file=sys.stderr, flush=True)
    from kvserve.server.profile import apply_profile

    apply_profile(args.model)  # before vLLM starts its engine: the engine's processes inherit what it sets
    configure_logging_from_args(args)
    refuse_other_frontends(args)  # before vLLM's own checks of those front ends' flags
    serve = ServeSubcommand()
    serve.validate(args)
    refuse_ray_where_vllm_cannot_run_it(args)
    refuse_several_api_servers(args)
    if args.headless:  # a node of a model split over several machines: its workers only, as `vllm serve` runs them
        from kvserve.server.headless import watch_head

        if args.node_rank > 0:  # a node holding workers of the head node's engine (multi-node TP/PP)
            watch_head(args.master_addr, args.master_port)
    else:
        # one API server in this process (`vllm serve` would start one per data-parallel engine by default)
        args.api_server_count = 1
    serve.cmd(args)


if __name__ == "__main__":
    main()
