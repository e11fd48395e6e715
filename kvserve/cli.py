"""`kvserve serve [MODEL] [--kv-* ...] [vllm flags ...]`: vLLM's OpenAI server with kvserve active.

Runs vLLM's OpenAI API server (`python -m kvserve.server.launch`, vLLM's own launcher after resolving the model),
passing every flag kvserve does not own to vLLM unchanged; MODEL may stand anywhere among them.
Server-wide eviction defaults come from `--kv-config FILE.yaml` and `--kv-*` flags (flags win); each request may
override them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from kvserve.allocator import allocator_env
from kvserve.config import (
    BUILTIN_DEFAULTS,
    CHECKPOINT_POLICY_KEY,
    DEFAULTS_ENV,
    parse_kv_config,
)
from kvserve.cpu_dtype import default_dtype, has_dtype_flag
from kvserve.effective_defaults import builtin_values, shown
from kvserve.environment import declared, default
from kvserve.errors import InvalidSetting
from kvserve.parallelism import parallel_env
from kvserve.policies import POLICY_NAMES
from kvserve.policy_settings import check_checkpoint_policy
from kvserve.server.profile import DEFAULT_TARGET
from kvserve.settings import SETTINGS


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve serve",
        description=__doc__,
        add_help=False,
        usage="kvserve serve [MODEL] [kvserve flags] [vLLM flags]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    general = parser.add_argument_group("server-wide eviction defaults (each request may override them)")
    general.add_argument(
        "--kv-config", type=Path, help="YAML file of kv_* defaults, examples in configs/ (default none)"
    )
    builtin = builtin_values()  # what the server applies without --kv-*: each flag's help shows its default
    for setting in SETTINGS:
        if not setting.server:
            continue
        allowed = POLICY_NAMES if setting.key == "kv_policy" else setting.choices
        text = f"{setting.help}: {', '.join(allowed)}" if allowed else setting.help
        applied = f"default {shown(builtin[setting.key])}"
        if setting.policy_default:
            applied += f", {builtin['kv_policy']}'s; with another --kv-policy, that policy's own"
        boolean = {"action": "store_true"} if setting.kind == "bool" else {}
        general.add_argument(setting.flag, dest=setting.key, default=None, help=f"{text} ({applied})", **boolean)
    profile = parser.add_argument_group("the model's profile (kvserve calibrate MODEL)")
    profile.add_argument(
        "--kv-profile",
        dest="profile_choice",
        default="auto",
        help="the profile to use: auto (kvserve's cache, if calibrated), a file, or none (default auto)",
    )
    profile.add_argument(
        "--kv-target",
        dest="profile_target",
        type=float,
        default=None,
        help=f"share of full whose recommended setting becomes the default (default {DEFAULT_TARGET}; any --kv-* "
        "default wins)",
    )
    knobs = parser.add_argument_group("policy settings (each applies to the policies that declare it)")
    for key, help_text in sorted(_knob_help().items()):
        knobs.add_argument("--" + key.replace("_", "-"), dest=key, default=None, help=help_text)
    return parser


def _knob_help() -> dict[str, str]:
    """kv_<knob> -> what it means to each policy declaring it. CAOTE variants (`<base>+caote`) take their base
    policy's settings and are not listed again."""
    from kvserve.policies import POLICIES

    meanings: dict[str, dict[str, list[str]]] = {}
    for policy, cls in sorted(POLICIES.items()):
        if "+" in policy:
            continue
        for setting in cls.knobs().values():
            meaning = f"{setting.help} (default {shown(setting.default)})"  # the policy's own, as the parser's
            meanings.setdefault(setting.key, {}).setdefault(meaning, []).append(policy)
    return {
        key: "; ".join(f"{', '.join(owners)}: {text}" for text, owners in by_help.items())
        for key, by_help in meanings.items()
    }


def defaults_from_args(args: argparse.Namespace) -> dict:
    """The server-wide kv_* defaults from --kv-config and --kv-* flags (flags win), checked before vLLM starts.
    Knobs and `kv_span` at the top level are the default policy's (`kv_policy`); a `policies:` section gives other
    policies' own (`kvserve.config.policy_defaults`)."""
    defaults: dict = {}
    if args.kv_config is not None:
        loaded = yaml.safe_load(args.kv_config.read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"kvserve: {args.kv_config} must hold a mapping of kv_* keys")
        defaults.update(loaded)
    flags = given_flags(args)
    defaults.update(flags)
    if "kv_policy" not in defaults:  # knobs alone (`--kv-window 64`) tune the built-in policy, not `full`
        defaults = {**BUILTIN_DEFAULTS, **defaults}
    try:  # fail at start-up, not on the first request
        check_checkpoint_policy(defaults)
        parse_kv_config({k: v for k, v in defaults.items() if k != CHECKPOINT_POLICY_KEY}, defaults={})
        for policy in _sections(defaults):
            parse_kv_config({"kv_policy": policy}, defaults=defaults)
    except InvalidSetting as exc:
        raise SystemExit(f"kvserve: invalid server default {exc}") from exc
    return defaults


def given_flags(args: argparse.Namespace) -> dict:
    """The kv_* settings the command line gives as flags."""
    return {k: v for k, v in vars(args).items() if k.startswith("kv_") and k != "kv_config" and v is not None}


def _sections(defaults: dict) -> dict[str, dict]:
    """The `policies:` section of the server defaults, each entry checked to hold that policy's own settings only."""
    from kvserve.config import POLICY_KEY, knob_keys
    from kvserve.policies import POLICIES

    sections = defaults.get(POLICY_KEY) or {}
    if not isinstance(sections, dict):
        raise SystemExit(f"kvserve: `{POLICY_KEY}:` must map policy names to their settings")
    for policy, settings in sections.items():
        if policy not in POLICIES or policy == "full" or not isinstance(settings, dict):
            raise SystemExit(f"kvserve: `{POLICY_KEY}:` maps an eviction policy to its settings; got {policy!r}")
        own = {setting.key for setting in POLICIES[policy].knobs().values()} | {"kv_span"}
        for key in settings:
            if key not in own:
                why = "applies to every policy: give it at the top level" if key not in knob_keys() else "is not one"
                raise SystemExit(
                    f"kvserve: `{POLICY_KEY}: {policy}:` takes {policy}'s own settings ({', '.join(sorted(own))}); "
                    f"{key} {why}"
                )
    return sections


def _has_flag(args: list[str], name: str) -> bool:
    return any(arg == name or arg.startswith(name + "=") for arg in args)


def help_flag(argv: list[str]) -> str | None:
    """The help flag among `argv`: `-h`, `--help`, or `vllm serve`'s `--help=all|SECTION|FLAG`; None without one."""
    return next((arg for arg in argv if arg in ("-h", "--help") or arg.startswith("--help=")), None)


def print_help(vllm_help: str = "--help") -> None:
    """kvserve's own flags first, then vLLM's as `vllm serve` prints them (every flag kvserve does not own goes to
    vLLM unchanged): all of them for `-h` / `--help`; `--help=SECTION` and `--help=FLAG` are vLLM's, passed on."""
    from kvserve.server.launch import VLLM_SERVE

    if vllm_help in ("-h", "--help"):
        vllm_help = "--help=all"  # vLLM's plain --help lists its sections only
    _serve_parser().print_help()
    print(f"\nvLLM's flags (vllm serve {vllm_help}):\n", flush=True)
    subprocess.run([*VLLM_SERVE, vllm_help], check=False)


def serve(argv: list[str]) -> None:
    asked_help = help_flag(argv)
    if asked_help is not None:
        print_help(asked_help)
        return
    # MODEL may stand anywhere among the flags, as in `vllm serve`: kvserve's parser takes only its own flags and
    # leaves MODEL among vLLM's, which the server process resolves with `--model` (kvserve/server/launch.py).
    args, vllm_args = _serve_parser().parse_known_args(argv)
    defaults = defaults_from_args(args)
    if not has_dtype_flag(vllm_args):
        dtype, why = default_dtype()
        vllm_args = [*vllm_args, "--dtype", dtype]
        print(f"kvserve: --dtype {dtype}: {why} (pass --dtype to choose)", file=sys.stderr, flush=True)
    env = os.environ
    for key, value in parallel_env(vllm_args, env).items():
        env[key] = value
        print(f"kvserve: {key}={value} (one CPU group per worker)", file=sys.stderr, flush=True)
    env[DEFAULTS_ENV] = json.dumps(defaults)
    from kvserve.server.profile import CHOICE_ENV, TARGET_ENV, USER_DEFAULTS_ENV

    # the server process applies the model's profile once it knows the model (kvserve/server/profile.py)
    env[CHOICE_ENV] = args.profile_choice
    env[USER_DEFAULTS_ENV] = "1" if args.kv_config is not None or given_flags(args) else "0"
    if args.profile_target is not None:
        if not 0 < args.profile_target <= 1:
            raise SystemExit(
                f"kvserve: --kv-target is a share of the full cache's score in (0, 1], not {args.profile_target}"
            )
        env[TARGET_ENV] = str(args.profile_target)
    # kvserve's metrics live in the engine-core process; multiprocess mode brings them to the API server's /metrics.
    env.setdefault(declared("PROMETHEUS_MULTIPROC_DIR"), tempfile.mkdtemp(prefix="kvserve-prom-"))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", default("VLLM_CPU_KVCACHE_SPACE"))
    added, allocator = allocator_env(env)  # tcmalloc, or glibc with a fixed mmap threshold (kvserve/allocator.py)
    env.update(added)
    print(f"kvserve: {allocator}", file=sys.stderr, flush=True)
    # Accumulating policies (h2o, ems) add O(n^2) CPU work to a long prefill step; on a loaded 2-core machine one
    # 3k-token h2o step passed vLLM's 300 s worker deadline and vLLM shut the engine down. Allow 30 minutes.
    env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", default("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"))
    # (the x-kv-* header middleware is installed by the plugin itself, inside vLLM's --api-key check)
    command = [sys.executable, "-m", "kvserve.server.launch"]
    if "--async-scheduling" not in vllm_args:
        command.append("--no-async-scheduling")  # eviction plans need schedule -> execute -> update in lockstep
    # (the API server logs what each policy gets from these defaults: kvserve.vllm.api_server, as under vllm serve)
    os.execve(sys.executable, command + vllm_args, env)


def setup_model_command(argv: list[str]) -> None:
    """`kvserve setup-model [NAME]`: print the folder of a model kvserve knows by name, fetched once."""
    from kvserve.catalog import DEFAULT_NAME, describe, setup_model

    parser = argparse.ArgumentParser(
        prog="kvserve setup-model",
        description="Fetch, check (SHA-256) and convert a model once (cached in $KVSERVE_CACHE or ~/.cache/kvserve) "
        "and print its folder. Models:\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", nargs="?", default=DEFAULT_NAME, help=f"the model (default {DEFAULT_NAME})")
    args = parser.parse_args(argv)
    try:
        print(setup_model(args.name))
    except RuntimeError as exc:  # a checksum refusal or a failed download: the reason, not a traceback
        raise SystemExit(str(exc)) from exc


def usage() -> str:
    """`kvserve --help`: every command, the eval and bench ones read from their own parsers and tables."""
    from kvserve.tools.bench.__main__ import COMMANDS, SERVER_PAIR_COMMANDS
    from kvserve.tools.eval.__main__ import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    evals = [(f"eval {choice.dest} ...", choice.help or "") for choice in subparsers._choices_actions]
    benches = [(f"bench {name} ...", text) for name, text in SERVER_PAIR_COMMANDS.items()]
    benches += [(f"bench {name} ...", text) for name, (_, text) in COMMANDS.items()]
    commands = [
        ("serve [MODEL] [--kv-* ...] [vllm flags]", "serve a model with eviction (kvserve serve --help: the flags)"),
        ("--version", "the version, and the vLLM release it patches"),
        *evals,
        *benches,
        ("report [DATA] -o PAGE", "rebuild the benchmarks page and its plots from the result files"),
        ("setup-model [NAME]", "fetch and convert a model once (default: the default model)"),
        ("calibrate [MODEL]", "a model's own head roles and recommended setting (its profile)"),
    ]
    width = max(len(command) for command, _ in commands)
    lines = [f"kvserve {command.ljust(width)}  {text}" for command, text in commands]
    return "usage: " + "\n       ".join(lines)


# `kvserve COMMAND ...`: the function that runs each ("module:function", imported only when that command runs, so each
# loads only what it needs); docs/reference/cli.md reads every command's flags from their parsers through this table
SUBCOMMANDS = {
    "serve": "kvserve.cli:serve",
    "eval": "kvserve.tools.eval.__main__:main",
    "bench": "kvserve.tools.bench.__main__:main",
    "report": "kvserve.tools.report.__main__:main",
    "setup-model": "kvserve.cli:setup_model_command",
    "calibrate": "kvserve.tools.calibrate.command:main",
}


def command_function(command: str) -> Callable[[list[str]], None]:
    """The function `kvserve COMMAND ARGS` calls with ARGS."""
    module, _, function = SUBCOMMANDS[command].partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    if argv[0] == "--version":
        from kvserve import REQUIRED_VLLM_VERSION, __version__

        print(f"kvserve {__version__} (for vLLM {REQUIRED_VLLM_VERSION})")
        return
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        raise SystemExit(f"kvserve: unknown command {command!r} ({', '.join(SUBCOMMANDS)})")
    command_function(command)(rest)


if __name__ == "__main__":
    main()
