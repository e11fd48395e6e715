"""Which KVzap surrogate serves which model: the served profile's (`kvserve calibrate MODEL --kvzap`, beside the
profile), else the one shipped in `kvserve/kvzap/surrogates/<model folder name>.safetensors`. A model is named by
its folder, the last component of vLLM's `--model`, as the gates and DuoAttention's roles are."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from kvserve.kvzap.surrogate import SurrogateSet

SHIPPED_DIR = Path(__file__).parent / "surrogates"


class NoSurrogateError(LookupError):
    pass


def surrogate_path(model: str) -> Path:
    """The surrogate file for vLLM's `--model` value; NoSurrogateError names the models that have one."""
    from kvserve.profile import PROFILE_ENV, served_profile

    name = Path(str(model).rstrip("/")).name
    profile = served_profile(name)
    if profile is not None and profile.kvzap:
        return Path(os.environ[PROFILE_ENV]).parent / profile.kvzap["file"]
    shipped = SHIPPED_DIR / f"{name}.safetensors"
    if not shipped.exists():
        known = ", ".join(sorted(p.stem for p in SHIPPED_DIR.glob("*.safetensors"))) or "none"
        raise NoSurrogateError(
            f"no KVzap surrogate for model {name!r} (shipped: {known}); train one with "
            "`kvserve calibrate MODEL_DIR --kvzap` (minutes; `kvserve serve` then finds it)"
        )
    return shipped


@cache
def checked_surrogates(model_dir: str) -> SurrogateSet:
    """The model's surrogates, refused (NoSurrogateError with the reason) unless trained for this very model folder
    (its shape and weights): what a request's validation asks, once per process."""
    path = surrogate_path(model_dir)
    try:
        return SurrogateSet.load(path, Path(model_dir))
    except ValueError as exc:
        raise NoSurrogateError(str(exc)) from exc


@cache
def surrogates_for(model: str) -> SurrogateSet:
    """The surrogates of the served model by its name (the worker's view, after the front end checked the file
    against the model folder), loaded once per process."""
    return SurrogateSet.load(surrogate_path(model))
