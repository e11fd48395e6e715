"""The process `kvserve serve` becomes: vLLM's OpenAI API server, started the way vLLM's own entry point starts it,
with the model resolved first.

vLLM's parser takes the model as `--model` or as a positional `model_tag` anywhere among the flags (as `vllm serve`
does); its own launcher would let a default `--model` win over that positional and serve another model without a
word. Here the positional and `--model` are one setting: a model given either way is served, two different ones are
refused, and none means kvserve's default model.
"""

from __future__ import annotations

import sys


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


def main(argv: list[str] | None = None) -> None:
    refuse_where_kvserve_cannot_evict()
    import uvloop
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    args = parse_serve_args(sys.argv[1:] if argv is None else argv)
    from kvserve import REQUIRED_VLLM_VERSION, __version__

    print(f"kvserve {__version__} (vLLM {REQUIRED_VLLM_VERSION}): serving {args.model}", file=sys.stderr, flush=True)
    from kvserve.server.profile import apply_profile

    apply_profile(args.model)  # before vLLM starts its engine: the engine's processes inherit what it sets
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    if args.headless:  # a node of a model split over several machines: its workers only (kvserve/server/headless.py)
        from kvserve.server import headless

        headless.run(args)
        return
    uvloop.run(entry.run_server(args))


if __name__ == "__main__":
    main()
