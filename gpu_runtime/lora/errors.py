"""Why an adapter directory cannot be served (torch- and peft-free, so the HTTP server can
answer these errors without importing the serving code)."""

from __future__ import annotations


class AdapterConfigError(ValueError):
    """An adapter directory this server cannot serve; the message names the field or tensor."""


class UnsupportedAdapterError(AdapterConfigError):
    """A valid PEFT adapter using an option this server does not serve (with peft's numbers);
    the message names the field, its value, and what to do instead."""
