"""How `kvserve serve MODEL` uses the model's profile: found by itself, checked before vLLM starts, then

- its head roles (and gates, if any) serve `duoattention` (and `attention_gate`) for that model: the engine finds
  the profile through PROFILE_ENV;
- its recommended setting for the target share (`--kv-target`, default 0.95) becomes the server's default, unless
  the command line gave eviction defaults (`--kv-*` flags or `--kv-config`), which win.

Both are logged at start-up. `--kv-profile FILE` names a profile; `--kv-profile none` serves without one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvserve.config import DEFAULTS_ENV, parse_kv_config
from kvserve.environment import declared, default
from kvserve.errors import InvalidSetting
from kvserve.profile import PROFILE_ENV, ProfileError, find_profile

CHOICE_ENV = declared("KVSERVE_PROFILE_CHOICE")  # `--kv-profile`: auto (default), none, or a file
TARGET_ENV = declared("KVSERVE_PROFILE_TARGET")  # `--kv-target`
USER_DEFAULTS_ENV = declared("KVSERVE_USER_DEFAULTS")  # "1" when the command line gave eviction defaults
DEFAULT_TARGET = float(default(TARGET_ENV))


def _say(text: str) -> None:
    print(f"kvserve: {text}", file=sys.stderr, flush=True)


def apply_profile(model: str, env: os._Environ | dict = os.environ) -> None:
    """Find, check and apply the profile of the model `kvserve serve` is about to serve (see the module's doc).
    Exits naming the file when a profile is corrupt, foreign, or made for another model or kvserve version."""
    choice = env.pop(CHOICE_ENV, "auto")
    env.pop(PROFILE_ENV, None)  # only the profile checked here reaches the engine
    if choice == "none":
        _say("profile: none (--kv-profile none)")
        return
    model_dir = Path(model).expanduser()
    if not (model_dir / "config.json").exists():
        if choice != "auto":
            raise SystemExit(f"kvserve: --kv-profile {choice}: {model} is not a local model folder to check it against")
        return
    try:
        found = find_profile(model_dir, None if choice == "auto" else Path(choice))
    except ProfileError as exc:
        raise SystemExit(f"kvserve: refusing the model's profile: {exc}") from exc
    if found is None:
        _say(f"profile: none for {model_dir.name} (`kvserve calibrate {model}` measures one)")
        return
    path, profile = found
    env[PROFILE_ENV] = str(path)
    gates = "an Attention-Gate" if profile.gates else "no Attention-Gate"
    _say(
        f"profile {path}: DuoAttention head roles ({profile.roles_recipe.get('method', 'measured')[:40]}...) and "
        f"{gates} for {profile.model}"
    )
    target = float(env.get(TARGET_ENV) or DEFAULT_TARGET)
    recommended = profile.recommended(target)
    if recommended is None:
        why = profile.check.get("why_none") or f"the check found no setting keeping {target:.0%} of full"
        _say(f"profile: no recommended setting for {target:.0%} of full ({why}); server defaults unchanged")
        return
    setting = {key: value for key, value in recommended.items() if key.startswith("kv_")}
    kept = f"{recommended['share']:.0%} of full on the check, 95% interval {recommended['interval']}"
    if env.get(USER_DEFAULTS_ENV) == "1":
        _say(f"profile: recommended {setting} ({kept}) not used: the command line gives eviction defaults")
        return
    try:
        parse_kv_config(setting, defaults={})
    except InvalidSetting as exc:
        raise SystemExit(f"kvserve: refusing the model's profile: {path} recommends an invalid setting: {exc}") from exc
    env[DEFAULTS_ENV] = json.dumps(setting)
    _say(f"server default from the profile, for {target:.0%} of full: {setting} ({kept})")
