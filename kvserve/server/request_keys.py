"""A request's kvserve keys, read off its headers and body: `x-kv-*` headers and top-level `kv_*` body keys merged
into `vllm_xargs` (a setting given twice with different values is a conflict, never a silent choice), and the
session (`kv_session`) taken out of them, since it routes and the engine never reads it (`affinity.py`)."""

from __future__ import annotations

from typing import Any

from kvserve.config import KEY_PREFIX
from kvserve.errors import InvalidSetting
from kvserve.server.affinity import SESSION_HEADERS, SESSION_KEY, check_session

HEADER_PREFIX = b"x-kv-"
MAX_HEADER_VALUE = 256


def headers_to_xargs(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The `kv_*` request keys given as `x-kv-*` headers, and `X-Session-ID` as `kv_session`."""
    xargs: dict[str, str] = {}
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1").lower()
        if name in SESSION_HEADERS:  # X-Session-ID (vLLM router's) names the session as x-kv-session does
            key = SESSION_KEY
        elif name.encode("latin-1").startswith(HEADER_PREFIX):
            key = KEY_PREFIX + name[len(HEADER_PREFIX) :].replace("-", "_")
        else:
            continue
        value = raw_value.decode("latin-1").strip()
        if key == SESSION_KEY and xargs.get(key, value) != value:
            raise InvalidSetting(key, f"the headers {', '.join(SESSION_HEADERS)} name different sessions")
        if key in xargs and key != SESSION_KEY:
            raise InvalidSetting(name, f"header {name} given more than once")
        if len(value) > MAX_HEADER_VALUE:
            raise InvalidSetting(name, f"header {name} is longer than {MAX_HEADER_VALUE} characters")
        xargs[key] = value
    return xargs


VLLM_KV_FIELDS = ("kv_transfer_params",)  # vLLM's own top-level request fields that start with kv_


def merge_into_body(body: dict[str, Any], header_xargs: dict[str, str]) -> dict[str, Any]:
    xargs = body.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, dict):
        raise InvalidSetting("vllm_xargs", "must be a JSON object")
    top_level = {
        key: body.pop(key)
        for key in list(body)
        if isinstance(key, str) and key.startswith(KEY_PREFIX) and key not in VLLM_KV_FIELDS
    }
    for source, settings in (("header x-kv-", header_xargs), ("body key kv_", top_level)):
        for key, value in settings.items():
            if key in xargs and str(xargs[key]).lower() != str(value).lower():
                name = source + (key[3:].replace("_", "-") if source.startswith("header") else key[3:])
                raise InvalidSetting(
                    key,
                    f"given as {name}={value!r} and as {xargs[key]!r} elsewhere in the request "
                    "(vllm_xargs, a header or a top-level body key); give it once",
                )
            xargs.setdefault(key, value)
    if xargs:
        body["vllm_xargs"] = xargs
    return body


def pop_session(body: dict[str, Any]) -> str | None:
    """Take `kv_session` (header, body key or vllm_xargs, merged) out of the request: it routes, the engine never
    reads it (`kvserve/server/affinity.py`)."""
    xargs = body.get("vllm_xargs") or {}
    if SESSION_KEY not in xargs:
        return None
    session = check_session(xargs.pop(SESSION_KEY))
    if not xargs:
        body.pop("vllm_xargs")
    return session
