"""`kvserve calibrate [MODEL]`: a model's own profile, which `kvserve serve MODEL` then uses without further flags.

1. Head roles for DuoAttention, measured from a few forward passes over synthetic retrieval samples
   (`kvserve/tools/calibrate/heads.py`; minutes, where the paper's training takes hours on a CPU for a 0.5B model).
2. With `--gates`, an Attention-Gate trained for the model (`kvserve/tools/training/gates.py`; slow: the estimate
   says how slow).
3. A short quality check through the model's own `kvserve serve` (`kvserve/tools/calibrate/check.py`): per target
   share of the full cache's score, the setting that needs the least memory.

Before it starts it prints an estimate of its time; a progress bar follows. Every phase keeps its results in a work
folder beside the profile, so an interrupted calibration resumes where it stopped; the profile itself is written
once, atomically, at the end (`$KVSERVE_CACHE/profiles/<model folder>.json` unless `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from kvserve import __version__
from kvserve.profile import Profile, ProfileRoles, fingerprint, profile_path
from kvserve.tools.calibrate.check import CheckPlan, run_check

ROLES_SEQ_LEN = 768


def resolve_model(name: str | None) -> Path:
    """MODEL: a model folder, a name `kvserve setup-model` knows (fetched once), or none for the default model."""
    from kvserve.catalog import MODEL_NAMES, setup_model

    if name is None or name in MODEL_NAMES:
        return setup_model(name or MODEL_NAMES[0])
    folder = Path(name).expanduser()
    if not (folder / "config.json").exists():
        raise SystemExit(
            f"kvserve calibrate: {name} is neither a model folder (no config.json) nor one of {', '.join(MODEL_NAMES)}"
        )
    return folder.resolve()


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's text as written, and each flag's default."""


def parser() -> argparse.ArgumentParser:
    plan = CheckPlan()
    p = argparse.ArgumentParser(prog="kvserve calibrate", description=__doc__, formatter_class=_Help)
    p.add_argument("model", nargs="?", default=None, help="model folder or known name (default: the default model)")
    p.add_argument("--out", type=Path, default=None, help="profile file (default: kvserve's cache, where serve looks)")
    p.add_argument("--roles-samples", type=int, default=8, help="retrieval samples the head roles are measured on")
    p.add_argument("--gates", action="store_true", help="also train an Attention-Gate for the model (slow)")
    p.add_argument("--gate-steps", type=int, default=100, help="Attention-Gate training steps (with --gates)")
    p.add_argument("--tasks", default=",".join(plan.tasks), help="judged tasks of the check")
    p.add_argument("--lengths", default=",".join(map(str, plan.lengths)), help="prompt lengths of the check")
    p.add_argument("--samples", type=int, default=plan.samples, help="cases per task and length")
    p.add_argument("--policies", default=",".join(plan.policies), help="policies the check compares")
    p.add_argument("--budgets", default=",".join(map(str, plan.budgets)), help="budgets B, each policy ascending")
    p.add_argument("--spans", default=",".join(map(str, plan.spans)), help="kv_span values of score-based policies")
    p.add_argument("--targets", default=",".join(f"{t:g}" for t in plan.targets), help="shares of full to meet")
    p.add_argument("--server-args", default="", help="extra flags for the check's `kvserve serve` (one string)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def plan_from(args: argparse.Namespace) -> CheckPlan:
    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(item) for item in text.split(",") if item)

    try:
        plan = CheckPlan(
            tasks=tuple(args.tasks.split(",")),
            lengths=ints(args.lengths),
            samples=args.samples,
            policies=tuple(args.policies.split(",")),
            budgets=ints(args.budgets),
            spans=ints(args.spans),
            targets=tuple(float(t) for t in args.targets.split(",")),
        )
        plan.settings()  # an unknown policy or knob fails here, before anything runs
        from kvserve.tools.eval.tasks import TASKS

        unknown = [task for task in plan.tasks if task not in TASKS]
        if unknown:
            raise ValueError(f"unknown task {unknown[0]!r} (known: {', '.join(TASKS)})")
        if not all(0 < t <= 1 for t in plan.targets):
            raise ValueError("--targets are shares of the full cache's score, in (0, 1]")
    except ValueError as exc:
        raise SystemExit(f"kvserve calibrate: {exc}") from exc
    return plan


def probe_seconds_per_token(model) -> float:
    """One forward of the reference model (`PlainLlama`) over ROLES_SEQ_LEN tokens: the machine's speed on it."""
    import torch

    ids = torch.zeros(1, ROLES_SEQ_LEN, dtype=torch.long)
    started = time.time()
    with torch.no_grad():
        model(ids)
    return (time.time() - started) / ROLES_SEQ_LEN


# Served prefill time per token against the reference forward's (fp32, attention materialised): measured 0.34 on
# Qwen2.5-Coder-0.5B with 2k-token prompts (5.5 s served, 16 s estimated at 1.0; AMD EPYC, 2 cores, bf16).
SERVED_PER_REFERENCE = 0.35


def estimate(args: argparse.Namespace, plan: CheckPlan, per_token: float) -> dict[str, float]:
    """Seconds per phase from the probe; the check's figure is an upper bound (early stops send fewer requests)."""
    phases = {"roles": args.roles_samples * ROLES_SEQ_LEN * per_token * 1.3, "server start": 120.0}
    mean_length = sum(plan.lengths) / len(plan.lengths)
    phases["check"] = plan.requests() * mean_length * per_token * SERVED_PER_REFERENCE
    if args.gates:  # forward and backward of the gated model and the teacher's forward, per 1,024-token step: the
        # default model's 100 steps took 848 s, about 4x its probe's time per token
        phases["gates"] = args.gate_steps * 1024 * per_token * 4
    return phases


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="step", desc="calibrate", file=sys.stderr)


def measured_roles_resumable(model_dir: Path, model, work: Path, samples: int, tick):
    """The measured roles, from the work folder when an earlier run measured them with the same settings."""
    from kvserve.duo.roles import HeadRoles
    from kvserve.tools.calibrate.heads import RECIPE, measured_roles

    saved = work / "roles.json"
    recipe = {**RECIPE, "samples": samples, "seq_len": ROLES_SEQ_LEN, "kvserve": __version__}
    if saved.exists():
        stored = json.loads(saved.read_text())
        if stored.get("recipe") == recipe:
            tick(samples)
            return HeadRoles.load(saved), recipe
    roles = measured_roles(model_dir, samples=samples, seq_len=ROLES_SEQ_LEN, progress=lambda _: tick(1), model=model)
    roles.save(saved, recipe)
    return roles, recipe


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    plan = plan_from(args)
    model_dir = resolve_model(args.model)
    out = args.out or profile_path(model_dir)
    work = out.with_name(out.stem + ".work")
    work.mkdir(parents=True, exist_ok=True)
    say = lambda text: print(f"kvserve calibrate: {text}", file=sys.stderr, flush=True)  # noqa: E731

    from kvserve.tools.training.llama import PlainLlama

    try:
        reference = PlainLlama(model_dir)  # loaded once: the probe and the roles read it
    except ValueError as exc:  # an architecture the reference model does not implement
        raise SystemExit(f"kvserve calibrate: {model_dir.name}: {exc}") from exc
    phases = estimate(args, plan, probe_seconds_per_token(reference))
    say(
        f"{model_dir.name}: about {sum(phases.values()) / 60:.0f} min on this machine ("
        + ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in phases.items())
        + f"; the check sends at most {plan.requests()} requests, fewer where settings stop early). "
        f"Interrupt any time: a rerun resumes from {work}"
    )
    started = time.time()
    check_requests = plan.requests()
    bar = _bar(args.roles_samples + check_requests, not args.quiet)
    roles, recipe = measured_roles_resumable(model_dir, reference, work, args.roles_samples, bar.update)
    del reference  # fp32 weights (2 GB for the 0.5B model): not held while the gates train or the check serves
    measured = ProfileRoles(roles.gates, roles.sink_tokens, roles.recent)
    profile = Profile(model_dir.name, fingerprint(model_dir), measured, recipe)
    if args.gates:
        profile.gates = train_gates(model_dir, out, work, args.gate_steps)
    provisional = work / "roles-profile.json"  # the check's server serves duoattention with these roles
    gates = profile.gates
    if gates:  # a profile names its gate file relative to its own folder
        profile.gates = {**gates, "file": os.path.relpath(out.parent / gates["file"], work)}
    profile.save(provisional)
    profile.gates = gates
    plan_file, rows = work / "check-plan.json", work / "check.jsonl"
    if not plan_file.exists() or json.loads(plan_file.read_text()) != asdict(plan):
        rows.unlink(missing_ok=True)  # another plan: its rows do not belong to this check
        plan_file.write_text(json.dumps(asdict(plan)))
    profile.check = check_through_server(model_dir, plan, provisional, rows, args.server_args, bar.update)
    profile.check["seconds"] = round(time.time() - started, 1)
    profile.check["estimated_seconds"] = round(sum(phases.values()), 1)
    profile.check["roles_samples"] = args.roles_samples
    bar.close()
    profile.save(out)
    say(f"wrote {out} in {profile.check['seconds'] / 60:.1f} min")
    print(summary(profile))


def train_gates(model_dir: Path, out: Path, work: Path, steps: int) -> dict:
    from kvserve.gates.gateset import file_sha256
    from kvserve.tools.training import gates

    gate_file = out.with_name(out.stem + ".gates.safetensors")
    if not gate_file.exists():
        partial = work / "gates.safetensors"
        gates.train(
            gates.parse_args(
                [
                    "--model",
                    str(model_dir),
                    "--steps",
                    str(steps),
                    "--out",
                    str(partial),
                    "--no-registry",
                    "--plot",
                    str(work / "gates.png"),
                    "--log",
                    str(work / "gates.jsonl"),
                ]
            )
        )
        partial.replace(gate_file)
    return {"file": gate_file.name, "sha256": file_sha256(gate_file)}


def check_through_server(model_dir: Path, plan: CheckPlan, profile: Path, rows: Path, server_args: str, tick) -> dict:
    import shlex

    from transformers import AutoTokenizer

    from kvserve.tools.bench.servers import running_server
    from kvserve.tools.eval.client import Server

    args = ["--kv-profile", str(profile), "--max-model-len", str(max(plan.lengths) + 1024), *shlex.split(server_args)]
    # The check is the only work on the machine: its worker takes every CPU this process may use (vLLM's default
    # leaves one to the API server, which waits on one request at a time here; 4k-token prompts of the 0.5B model
    # took 24-31 s on one of 2 cores, 13-14 s on both).
    cpus = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))
    env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpus)}
    with running_server("kvserve", str(model_dir), args, rows.with_name("server.log"), env=env) as url:
        return run_check(Server(url, timeout=1800), plan, AutoTokenizer.from_pretrained(model_dir), rows, tick)


def summary(profile: Profile) -> str:
    check = profile.check
    lines = [f"{profile.model}: the full cache answers {check['full_answers']} of {check['cases']} check cases"]
    for result in check["results"]:
        state = "" if result["complete"] else " (stopped early)"
        lines.append(
            f"  {result['label']:<32} B={result['budget']:<4} share {result['share']:.2f} "
            f"[{result['low']:.2f}, {result['high']:.2f}] over {result['answered']}{state}"
        )
    for target, setting in check["recommended"].items():
        lines.append(
            f"recommended for {float(target):.0%} of full: "
            + (
                json.dumps({k: v for k, v in setting.items() if k.startswith("kv_")})
                if setting
                else f"none ({check.get('why_none', 'no setting reached it')})"
            )
        )
    return "\n".join(lines)
