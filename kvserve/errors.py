"""The one error kvserve raises for a setting it refuses, wherever the setting came from: a request's `kv_*` keys or
`x-kv-*` headers, the request body the HTTP middleware reads, or a server default at start-up."""

from __future__ import annotations


class InvalidSetting(ValueError):
    """A refused setting; `field` names the request key, header or body field at fault (the HTTP answer is a 400
    whose `param` is this field)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
