"""`kvserve calibrate [MODEL]`: a model's own profile, which `kvserve serve MODEL` then uses without further flags.

1. Head roles for DuoAttention, measured from a few forward passes over synthetic retrieval samples
   (`kvserve/tools/calibrate/heads.py`; minutes, where the paper's training takes hours on a CPU for a 0.5B model).
2. With `--gates`, an Attention-Gate trained for the model (`kvserve/tools/training/gates.py`; slow: the estimate
   says how slow).
3. With `--kvzap`, KVzap's surrogate trained for the model (`kvserve/tools/training/kvzap.py`: KVzip+ scores of the
   prose corpus, a linear or one-hidden-layer model per layer, its held-out fit printed), beside the profile.
4. A short quality check through the model's own `kvserve serve` (`kvserve/tools/calibrate/check.py`): per target
   share of the full cache's score, the setting that needs the least memory.

Before it starts it prints an estimate of its time (at the requests the check is expected to send, not the most it
could), and a revised one once the check's server has answered its first cases; a progress bar follows. Every phase
keeps its results in a work folder beside the profile, so an interrupted calibration resumes where it stopped; the
profile itself is written once, atomically, at the end (`$KVSERVE_CACHE/profiles/<model folder>.json` unless
`--out`). However it stops (Ctrl-C, SIGTERM, a server that exits or stalls, a failed request), it ends its server and
everything the server started, and says in one line what stopped, where the server's log is and the command that
resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve import __version__
from kvserve.profile import PROFILES_ENV, Profile, ProfileRoles, fingerprint, profile_path
from kvserve.tools.calibrate.check import CheckPlan, case_count, expected_requests, run_check
from kvserve.tools.eval.client import load_rows

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
    p.add_argument("--kvzap", action="store_true", help="also train KVzap's surrogate for the model")
    p.add_argument("--kvzap-kind", choices=("linear", "mlp"), default="linear", help="the surrogate (with --kvzap)")
    p.add_argument("--kvzap-texts", type=int, default=32, help="512-token corpus windows it trains on (--kvzap)")
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


# Served prefill time per token against the reference forward's (fp32, attention materialised): measured on
# Qwen2.5-Coder-0.5B with 2k-token prompts (AMD EPYC, 2 cores, bf16), rounded up.
SERVED_PER_REFERENCE = 0.35
KVZAP_TOKENS = 512  # tokens per corpus window KVzap's surrogate trains on


def estimate(args: argparse.Namespace, plan: CheckPlan, per_token: float) -> dict[str, float]:
    """Seconds per phase from the probe; the check's at the requests it is expected to send (`expected_requests`:
    the upper bound had put the recorded Qwen2.5-Coder-0.5B calibration well above its measured time)."""
    phases = {"roles": args.roles_samples * ROLES_SEQ_LEN * per_token * 1.3, "server start": 120.0}
    phases["check"] = expected_requests(plan) * served_seconds_per_request(plan, per_token)
    if args.gates:  # forward and backward of the gated model and the teacher's forward, per 1,024-token step: the
        # default model's training measured this factor over its probe's time per token
        phases["gates"] = args.gate_steps * 1024 * per_token * 4
    if args.kvzap:  # one reference forward over each window's context, instruction and copy (about 2 x 512 tokens)
        phases["kvzap"] = args.kvzap_texts * 1.25 * 2 * KVZAP_TOKENS * per_token * 1.5
    return phases


def served_seconds_per_request(plan: CheckPlan, per_token: float) -> float:
    """A served request of the check at its mean prompt length, from the reference probe's time per token."""
    return sum(plan.lengths) / len(plan.lengths) * per_token * SERVED_PER_REFERENCE


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f}" if seconds >= 600 else f"{seconds / 60:.1f}"


class ServedProbe:
    """The served probe: times the first requests the check's server answers in this run (on a fresh run the full
    cache's answers to every case, which the check sends first), then says once how long the rest should take at
    that speed. The reference forward times another computation than the server's, and other work on the machine
    slows it by more than it slows a served request. Measured on 2 cores (Qwen2.5-Coder-0.5B, default plan;
    docs/eval/qwen05/calibrate.json): 19 min estimated first, 14 min revised, 13.3 min taken."""

    def __init__(self, plan: CheckPlan, rows: Path, started: float) -> None:
        self.plan, self.rows, self.started = plan, rows, started
        self.seconds: list[float] = []
        self.revised_seconds: float | None = None  # the whole calibration's, from `started`, once revised

    def __call__(self, row: dict) -> None:
        self.seconds.append(row["seconds"])
        if len(self.seconds) == case_count(self.plan):
            self.revise()

    def revise(self) -> None:
        per_request = sum(self.seconds) / len(self.seconds)
        left = requests_left(self.plan, load_rows(str(self.rows)))
        self.revised_seconds = time.time() - self.started + left * per_request
        say(
            f"revised: about {minutes(left * per_request)} min left ({per_request:.1f} s a request over the "
            f"server's first {len(self.seconds)}; about {left:.0f} more requests expected)"
        )


def requests_left(plan: CheckPlan, rows: list[dict]) -> float:
    """The requests the check is still expected to send, given the rows it has (the full cache's tell how many cases
    the other settings answer)."""
    full = [row for row in rows if row["policy"] == "full"]
    kept = sum(row["score"] >= 1.0 for row in full) if len(full) == case_count(plan) else None
    return max(expected_requests(plan, kept) - len(rows), 0.0)


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


def say(text: str) -> None:
    print(f"kvserve calibrate: {text}", file=sys.stderr, flush=True)


@dataclass
class Progress:
    """Where the calibration is: what its one-line message says when it stops."""

    phase: str = "at its start"
    server_log: Path | None = None


class Stopped(Exception):
    """The check's server failed it (`what`, a few words); the calibration stops and says how to resume."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class SignalStop(KeyboardInterrupt):
    """SIGTERM or SIGHUP raised where calibrate is, like Ctrl-C, so that its `finally` blocks end the server: the
    default action ends the process at once and leaves the server (in a session of its own) and its engine running."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_signal_stop(signum: int, frame) -> None:
    raise SignalStop(signum)


@contextmanager
def signals_raised() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SignalStop while the calibration runs (the main thread only can set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_signal_stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def resume_command(argv: list[str]) -> str:
    """The command that resumes: the same arguments, and the variables that place the work folder where they are set
    (a rerun in another shell finds it too)."""
    places = [
        f"{name}={shlex.quote(os.environ[name])}" for name in (PROFILES_ENV, "KVSERVE_CACHE") if os.environ.get(name)
    ]
    return " ".join([*places, shlex.join(["kvserve", "calibrate", *argv])])


def stop_line(what: str, progress: Progress, argv: list[str]) -> str:
    log = f"; the server's log: {progress.server_log}" if progress.server_log else ""
    return f"stopped {progress.phase}: {what}{log}. Resume with: {resume_command(argv)}"


def main(argv: list[str] | None = None) -> None:
    from kvserve.tools.bench.servers import ServerStartError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    plan = plan_from(args)
    progress = Progress()
    try:
        with signals_raised():
            calibrate(args, plan, progress)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP: the server has been ended by now
        signum = exc.signum if isinstance(exc, SignalStop) else signal.SIGINT
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        say(stop_line(f"interrupted ({name}); its server and everything it started are ended", progress, argv))
        raise SystemExit(128 + signum) from None
    except ServerStartError as exc:
        raise SystemExit("kvserve calibrate: " + stop_line(f"the server {exc.what}", progress, argv)) from None
    except Stopped as exc:
        raise SystemExit("kvserve calibrate: " + stop_line(exc.what, progress, argv)) from None


def calibrate(args: argparse.Namespace, plan: CheckPlan, progress: Progress) -> None:
    from kvserve.tools.training.llama import PlainLlama

    progress.phase = "while setting up the model"
    model_dir = resolve_model(args.model)
    out = args.out or profile_path(model_dir)
    work = out.with_name(out.stem + ".work")
    work.mkdir(parents=True, exist_ok=True)
    progress.phase = "while loading the reference model"
    try:
        reference = PlainLlama(model_dir)  # loaded once: the probe and the roles read it
    except ValueError as exc:  # an architecture the reference model does not implement
        raise SystemExit(f"kvserve calibrate: {model_dir.name}: {exc}") from exc
    phases = estimate(args, plan, probe_seconds_per_token(reference))
    say(
        f"{model_dir.name}: about {minutes(sum(phases.values()))} min on this machine ("
        + ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in phases.items())
        + f"; the check is expected to send {expected_requests(plan):.0f} requests, at most {plan.requests()}; "
        "a revised estimate follows its server's first answers). "
        f"Interrupt any time: a rerun resumes from {work}"
    )
    started = time.time()
    with _bar(args.roles_samples + plan.requests(), not args.quiet) as bar:
        progress.phase = "while measuring the head roles"
        roles, recipe = measured_roles_resumable(model_dir, reference, work, args.roles_samples, bar.update)
        del reference  # fp32 weights (2 GB for the 0.5B model): not held while the gates train or the check serves
        measured = ProfileRoles(roles.gates, roles.sink_tokens, roles.recent)
        profile = Profile(model_dir.name, fingerprint(model_dir), measured, recipe)
        if args.gates:
            progress.phase = "while training the Attention-Gate"
            profile.gates = train_gates(model_dir, out, work, args.gate_steps)
        if args.kvzap:
            progress.phase = "while training KVzap's surrogate"
            profile.kvzap = train_kvzap(model_dir, out, args.kvzap_kind, args.kvzap_texts)
        provisional = provisional_profile(profile, out, work)
        rows = check_rows(plan, work)
        probe = ServedProbe(plan, rows, started)
        profile.check = check_through_server(
            model_dir, plan, provisional, rows, args.server_args, bar.update, probe, progress
        )
    profile.check["seconds"] = round(time.time() - started, 1)
    profile.check["estimated_seconds"] = round(sum(phases.values()), 1)
    # from the served probe; None when this run's server answered too few requests (a resumed check nearly done)
    revised = probe.revised_seconds
    profile.check["revised_estimated_seconds"] = None if revised is None else round(revised, 1)
    profile.check["roles_samples"] = args.roles_samples
    profile.save(out)
    say(f"wrote {out} in {minutes(profile.check['seconds'])} min")
    print(summary(profile))


def provisional_profile(profile: Profile, out: Path, work: Path) -> Path:
    """The profile so far, in the work folder: the check's server serves duoattention with its roles."""
    provisional = work / "roles-profile.json"
    gates = profile.gates
    if gates:  # a profile names its gate file relative to its own folder
        profile.gates = {**gates, "file": os.path.relpath(out.parent / gates["file"], work)}
    profile.save(provisional)
    profile.gates = gates
    return provisional


def check_rows(plan: CheckPlan, work: Path) -> Path:
    """The check's rows in the work folder: kept for a rerun of the same plan, dropped for another plan."""
    plan_file, rows = work / "check-plan.json", work / "check.jsonl"
    if not plan_file.exists() or json.loads(plan_file.read_text()) != asdict(plan):
        rows.unlink(missing_ok=True)  # another plan: its rows do not belong to this check
        plan_file.write_text(json.dumps(asdict(plan)))
    return rows


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
                    # a short run's evaluations (about seven of them) no longer than its training
                    "--eval-windows",
                    str(max(1, min(gates.EVAL_WINDOWS, steps // 10))),
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


def train_kvzap(model_dir: Path, out: Path, kind: str, texts: int) -> dict:
    """KVzap's surrogate beside the profile (kept for a rerun: a resumed calibration does not train it again)."""
    from kvserve.gates.gateset import file_sha256
    from kvserve.tools.training import kvzap

    surrogate_file = out.with_name(f"{out.stem}.kvzap-{kind}.safetensors")
    fit = None
    if not surrogate_file.exists():
        partial = surrogate_file.with_name(surrogate_file.name + ".partial")
        argv = [str(model_dir), "--kind", kind, "--texts", str(texts), "--tokens", str(KVZAP_TOKENS)]
        result = kvzap.run(kvzap.parse_args([*argv, "--out", str(partial)]))
        partial.replace(surrogate_file)
        fit = result.fit
    if fit is None:
        fit = kvzap.SurrogateSet.load(surrogate_file, model_dir).fit
    return {
        "file": surrogate_file.name,
        "sha256": file_sha256(surrogate_file),
        "kind": kind,
        "fit": {name: round(sum(f[name] for f in fit) / len(fit), 4) for name in ("r2", "spearman")},
    }


def check_through_server(
    model_dir: Path,
    plan: CheckPlan,
    profile: Path,
    rows: Path,
    server_args: str,
    tick: Callable[[int], None],
    served: Callable[[dict], None],
    progress: Progress,
) -> dict:
    import httpx
    from transformers import AutoTokenizer

    from kvserve.tools.bench.servers import running_server
    from kvserve.tools.eval.client import Server

    args = ["--kv-profile", str(profile), "--max-model-len", str(max(plan.lengths) + 1024), *shlex.split(server_args)]
    # The check is the only work on the machine: its worker takes every CPU this process may use (vLLM's default
    # leaves one to the API server, which waits on one request at a time here; 4k-token prompts of the 0.5B model
    # ran markedly faster on both of 2 cores than on one).
    cpus = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))
    env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpus)}
    progress.phase, progress.server_log = "during the check's server start-up", rows.with_name("server.log")
    with running_server("kvserve", str(model_dir), args, progress.server_log, env=env) as url:
        progress.phase = "during the check"
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        try:
            return run_check(Server(url, timeout=1800), plan, tokenizer, rows, tick, served)
        except (httpx.HTTPError, RuntimeError) as exc:  # the server failing a request, or gone
            raise Stopped(f"the check's server failed a request: {str(exc).splitlines()[0][:300]}") from exc


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
