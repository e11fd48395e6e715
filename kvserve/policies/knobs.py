"""A policy's per-request settings ("knobs"), declared as dataclass fields.

A policy declares `window: int = knob(32, "observation window ...", minimum=1)`, and everything a user sees of the
setting follows from that line: the request key `kv_window`, the header `x-kv-window`, the check of a value (the 400
message names the key), `kvserve serve --help` (with its default), and docs/reference/settings.md
(`python -m kvserve.tools.reference`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any, get_args, get_type_hints

from kvserve.errors import InvalidSetting

KEY_PREFIX = "kv_"  # request keys (vllm_xargs) of eviction settings
HEADER_PREFIX = "x-kv-"  # the same settings as HTTP headers
_METADATA_KEY = "kvserve.knob"


@dataclass(frozen=True)
class Knob:
    """One setting: its name, type and default (from the dataclass field) and what values it accepts."""

    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    odd: bool = False
    name: str = ""
    kind: type = int  # int, float or str: the field's annotation
    default: Any = None
    optional: bool = False  # annotated `X | None`: None (no value, the default) turns the setting off

    @property
    def key(self) -> str:
        return KEY_PREFIX + self.name

    @property
    def header(self) -> str:
        return HEADER_PREFIX + self.name.replace("_", "-")

    def parse(self, raw: Any) -> Any:
        """The value `raw` (a JSON value or a header's text) stands for, or InvalidSetting naming this knob's key."""
        if raw is None and self.optional:
            return None
        if self.kind is str:
            if not isinstance(raw, str) or (self.choices and raw not in self.choices):
                raise InvalidSetting(self.key, f"must be one of {', '.join(self.choices or ())}, got {raw!r}")
            return raw
        value = parse_int(self.key, raw) if self.kind is int else parse_float(self.key, raw)
        if self.minimum is not None and value < self.minimum:
            raise InvalidSetting(self.key, f"must be >= {self.minimum}, got {value}")
        if self.maximum is not None and value > self.maximum:
            raise InvalidSetting(self.key, f"must be <= {self.maximum}, got {value}")
        if self.odd and value % 2 == 0:
            raise InvalidSetting(self.key, f"must be odd, got {value}")
        return value


def knob(
    default: Any,
    help: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] | None = None,
    odd: bool = False,
) -> Any:
    """A dataclass field that is a per-request setting of its policy."""
    limits = Knob(help, minimum=minimum, maximum=maximum, choices=choices, odd=odd)
    return dataclasses.field(default=default, metadata={_METADATA_KEY: limits})


@cache
def knobs_of(cls: type) -> dict[str, Knob]:
    """The knobs a policy class declares, in declaration order (inherited ones first)."""
    hints = get_type_hints(cls)
    declared: dict[str, Knob] = {}
    for field in dataclasses.fields(cls):
        limits = field.metadata.get(_METADATA_KEY)
        if limits is None:
            raise TypeError(f"{cls.__name__}.{field.name}: a policy's fields are its settings; declare it with knob()")
        kind = hints[field.name]
        optional = type(None) in get_args(kind)
        if optional:  # `float | None`: its one other type
            (kind,) = (arg for arg in get_args(kind) if arg is not type(None))
        if kind not in (int, float, str):
            raise TypeError(f"{cls.__name__}.{field.name}: a knob is an int, float or str, not {kind}")
        declared[field.name] = dataclasses.replace(
            limits, name=field.name, kind=kind, default=field.default, optional=optional
        )
    return declared


def parse_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise InvalidSetting(key, f"must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value.strip())
    raise InvalidSetting(key, f"must be an integer, got {value!r}")


def parse_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise InvalidSetting(key, f"must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InvalidSetting(key, f"must be a number, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise InvalidSetting(key, f"must be a finite number, got {value!r}")
    return number


def parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise InvalidSetting(key, f"must be true or false, got {value!r}")
