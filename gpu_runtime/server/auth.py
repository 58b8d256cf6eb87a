"""Who may call what: the server asks one `RequestAuth` for each request's `ModelAccess`.

A `RequestAuth` reads the request's headers and answers with the models the request may call,
or raises `AccessDenied` (the server answers 401 and logs the reason). Two kinds exist: a host
behind the gateway checks the gateway's signed grant (`gpu_runtime.server.grant_auth`), a
stand-alone server or a host that still takes tenants' keys checks the bearer key
(`gpu_runtime.server.bearer_keys`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ModelAccess:
    """What an accepted request may call. `models` are the model names it may use (None: every
    model the server serves); any other model reads as nonexistent to it (404, never 403),
    unless `unlisted` allows it by name."""

    models: frozenset[str] | None = None
    unlisted: Callable[[str], bool] | None = field(default=None, compare=False)
    """Whether the request may call a model its list leaves out (a job's checkpoint: the
    control plane lists none, as OpenAI's `/v1/models` does not), asked per name; may block."""
    tenant: str = ""
    """Who is calling, for the logs ("" when the credential does not say)."""
    request_id: str = ""
    """The gateway's id of the request, for the logs ("" without a gateway)."""
    key_id: str = ""
    """A fingerprint of the bearer key (a SHA-256 prefix, never the key) when the credential
    names no tenant; "" otherwise."""

    @property
    def caller(self) -> str:
        """Whom the engine's admission is fair across: the tenant, else the bearer key's
        fingerprint ("" when neither is known: such requests share one turn)."""
        if self.tenant:
            return self.tenant
        return f"key:{self.key_id}" if self.key_id else ""

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def allows_unlisted(self, model: str) -> bool:
        """`allows`, else the answer of `unlisted` (may block: call it from a worker thread)."""
        if self.allows(model):
            return True
        return self.unlisted is not None and self.unlisted(model)


class AccessDenied(PermissionError):
    """The request's credential is missing or refused; the message says why and never holds
    the credential itself."""


class RequestAuth(Protocol):
    """Turns a request's headers into its `ModelAccess`."""

    async def access(self, headers: Mapping[str, str]) -> ModelAccess:
        """The request's access, or AccessDenied. Runs on the event loop: an implementation
        whose check may block hands it to a worker thread itself."""
        ...


ApiKeyChecker = Callable[[str | None], ModelAccess | None]
"""A bearer key's access (the key is None when absent), or None to refuse it (401). May block
(`BearerKeys` calls it from a worker thread)."""

ALL_MODELS = ModelAccess()
