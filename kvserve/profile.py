"""A model's kvserve profile: what `kvserve calibrate MODEL` learnt about one model, read by `kvserve serve MODEL`.

One JSON file per model in kvserve's cache (`$KVSERVE_CACHE/profiles/<model folder>.json`, or `$KVSERVE_PROFILES/`;
outside any repository), beside an optional Attention-Gate file. It holds
- whom it is for: the model's folder name and a fingerprint of the model (its config.json's SHA-256 and the sizes of
  its weight files), and the kvserve version that made it;
- the model's DuoAttention head roles (as `kvserve.duo.roles.HeadRoles` reads them) and, when asked for, its gates;
- the quality check's results and, per target share of the full cache's score, the setting that needs the least
  memory (or why there is none).

A profile is used only when all of that matches: a file that is not a profile is a start-up error naming it; one
made for another model, or by another kvserve version, is refused with the reason (run `kvserve calibrate` again).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

from kvserve import __version__
from kvserve.environment import declared
from kvserve.model import cache_dir

FORMAT = 1
PROFILE_ENV = declared("KVSERVE_PROFILE")  # set by `kvserve serve` for its engine: the profile it checked at start-up


class ProfileError(ValueError):
    pass


PROFILES_ENV = declared("KVSERVE_PROFILES")  # where profiles live (default: kvserve's cache folder's profiles/)


def profiles_dir() -> Path:
    return Path(os.environ.get(PROFILES_ENV) or cache_dir() / "profiles").expanduser()


def profile_path(model_dir: Path) -> Path:
    return profiles_dir() / f"{Path(model_dir).name}.json"


def fingerprint(model_dir: Path) -> dict:
    """What identifies a model folder cheaply: its config's SHA-256 and its weight files' sizes (no hashing of GBs)."""
    model_dir = Path(model_dir)
    return {
        "config_sha256": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "weights": {p.name: p.stat().st_size for p in sorted(model_dir.glob("*.safetensors"))},
    }


@dataclass(frozen=True)
class ProfileRoles:
    """DuoAttention head roles as `kvserve.duo.roles.HeadRoles` reads them: a gate per (layer, KV head) and the
    streaming window they were measured for."""

    gates: torch.Tensor  # [L, H_kv] in [0, 1]
    sink_tokens: int
    recent: int


@dataclass
class Profile:
    model: str
    fingerprint: dict
    roles: ProfileRoles
    roles_recipe: dict
    check: dict = field(default_factory=dict)  # the quality check's settings, results and recommendations
    gates: dict | None = None  # {"file": name beside the profile, "sha256": ...}
    # KVzap's surrogate (`kvserve calibrate --kvzap`): {"file": name beside the profile, "sha256", "kind", "fit"}
    kvzap: dict | None = None
    kvserve: str = __version__

    def recommended(self, target: float) -> dict | None:
        """The kv_* settings recommended for `target` (a share of full), or None where the check found none."""
        return (self.check.get("recommended") or {}).get(f"{target:g}")

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "kvserve": self.kvserve,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "roles": {
                "sink_tokens": self.roles.sink_tokens,
                "recent": self.roles.recent,
                "gates": [[round(float(g), 6) for g in layer] for layer in self.roles.gates],
                "recipe": self.roles_recipe,
            },
            "gates": self.gates,
            "kvzap": self.kvzap,
            "check": self.check,
        }

    def save(self, path: Path) -> None:
        """Atomically: an interrupted write never leaves a half profile where the server looks."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        partial.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        partial.replace(path)


def read_profile(path: Path) -> Profile:
    """The profile in `path`, or ProfileError naming the file and what is wrong with it (format only)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path} is not a kvserve profile: {exc}") from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ProfileError(f"{path} is not a kvserve profile (format {FORMAT} expected)")
    try:
        roles = record["roles"]
        gates = torch.tensor(roles["gates"], dtype=torch.float32)
        if gates.dim() != 2 or not torch.all((gates >= 0) & (gates <= 1)):
            raise ValueError("roles.gates must be a [layers][KV heads] table of values in [0, 1]")
        check = dict(record.get("check") or {})
        for target, setting in (check.get("recommended") or {}).items():
            _check_recommendation(target, setting)
        return Profile(
            model=str(record["model"]),
            fingerprint=dict(record["fingerprint"]),
            roles=ProfileRoles(gates, int(roles["sink_tokens"]), int(roles["recent"])),
            roles_recipe=dict(roles.get("recipe") or {}),
            check=check,
            gates=record.get("gates"),
            kvzap=record.get("kvzap"),
            kvserve=str(record["kvserve"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{path} is not a kvserve profile: {exc}") from exc


def _check_recommendation(target: str, setting: object) -> None:
    """A recommendation the server can apply and log: kv_* settings with the share it kept and its interval."""
    if setting is None:
        return
    if not isinstance(setting, dict):
        raise ValueError(f"check.recommended[{target!r}] must be an object or null")
    float(target)
    if not any(key.startswith("kv_") for key in setting):
        raise ValueError(f"check.recommended[{target!r}] has no kv_* setting")
    share, interval = setting.get("share"), setting.get("interval")
    if not isinstance(share, (int, float)) or not (isinstance(interval, list) and len(interval) == 2):
        raise ValueError(f"check.recommended[{target!r}] needs a numeric share and a [low, high] interval")


def check_profile(profile: Profile, path: Path, model_dir: Path) -> None:
    """Refuse a profile made for another model or by another kvserve version, saying which."""
    model_dir = Path(model_dir)
    if profile.model != model_dir.name:
        raise ProfileError(f"{path} was made for model {profile.model!r}, not {model_dir.name!r}")
    if profile.fingerprint != fingerprint(model_dir):
        raise ProfileError(
            f"{path} was made for another {profile.model!r}: the folder's config.json or weight files differ from "
            f"those the profile was measured on (run `kvserve calibrate {model_dir}` again)"
        )
    if profile.kvserve != __version__:
        raise ProfileError(
            f"{path} was made by kvserve {profile.kvserve}; this is kvserve {__version__}, whose policies may score "
            f"differently (run `kvserve calibrate {model_dir}` again)"
        )


def find_profile(model_dir: Path, explicit: Path | None = None) -> tuple[Path, Profile] | None:
    """The checked profile for the model folder: `explicit` if given, else the cache's profile for it if any."""
    path = Path(explicit) if explicit is not None else profile_path(model_dir)
    if explicit is None and not path.exists():
        return None
    profile = read_profile(path)
    check_profile(profile, path, model_dir)
    return path, profile


@cache
def _served_profile(path: str) -> Profile:
    return read_profile(Path(path))


def served_profile(model_name: str) -> Profile | None:
    """In the server's processes: the profile `kvserve serve` checked at start-up, if it is for `model_name`."""
    path = os.environ.get(PROFILE_ENV)
    if not path:
        return None
    profile = _served_profile(path)
    return profile if profile.model == Path(model_name).name else None
