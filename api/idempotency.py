"""`Idempotency-Key` on the tenant API's writes: a POST retried with the same key is done once.

The contract (README, "Tenant API", "Retries and idempotency keys"):

* A key is 1-255 characters of `A-Z a-z 0-9 - _ . : ~ + / =` (a UUID, or a client library's
  generated key); anything else is a 400 (`invalid_idempotency_key`), before any work.
* The first request with a key claims it: a row is inserted (and committed) for the tenant and
  key (one per tenant and key: a unique constraint), holding the request's fingerprint (method,
  path and a SHA-256 of its body as parsed: a multipart body's fields and file contents, so a
  new boundary is the same request). The work then runs in one transaction that also stores
  its response in the row, conditional on still holding the claim: the writes and the stored
  response commit together, or neither does.
* A later request with the key: the same fingerprint gets the stored response (status and
  body, with `Idempotent-Replayed: true`) and nothing is done again; another fingerprint is a
  422 (`idempotency_key_reused`); while the first is still in flight, a 409
  (`idempotency_key_in_use`, `Retry-After`). Another tenant's same key is unrelated.
* Only a success (2xx) is stored. A refused request (4xx) or a failure rolls its work back and
  frees the key, so the same key may be sent again once the cause is fixed.
* A claim whose request died (the web process killed mid-request) is taken over by a retry
  after `HARLI_IDEMPOTENCY_LOCK_S`; nothing of the dead request committed (its work and its
  completion are one transaction), and should it still be running, its completion finds the
  claim gone and rolls back. Keys expire `HARLI_IDEMPOTENCY_KEY_RETENTION_H` hours after first
  use (24 by default); the janitor deletes expired rows and an expired key is claimed afresh.

Views opt in with :func:`idempotent` on a handler (every tenant POST that writes), which also
documents the header in the OpenAPI schema.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from api.errors import ConflictError, HarliError
from api.models import IdempotencyKey, Tenant
from api.models.idempotency import IDEMPOTENCY_KEY_MAX_LENGTH

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
KEY_PATTERN = re.compile(rf"^[A-Za-z0-9\-_.:~+/=]{{1,{IDEMPOTENCY_KEY_MAX_LENGTH}}}$")

HEADER_PARAMETER = OpenApiParameter(
    HEADER,
    str,
    location=OpenApiParameter.HEADER,
    required=False,
    description=(
        "Makes a retry of this request safe: the first request with a key does the work; a "
        "retry with the same key and the same request answers the stored response (header "
        f"`{REPLAYED_HEADER}: true`) without doing it again. The same key with another "
        "request: 422 `idempotency_key_reused`; while the first is still in flight: 409 "
        "`idempotency_key_in_use`. 1-255 of A-Z a-z 0-9 - _ . : ~ + / =; kept 24 hours. Only "
        "a success is stored: after a 4xx the key may be sent again."
    ),
)


class IdempotencyClaimLost(ConflictError):
    """The request's claim was taken over (it ran past HARLI_IDEMPOTENCY_LOCK_S)."""


@dataclass(frozen=True)
class Claim:
    """This request holds the key's row `pk` under the token `token`."""

    pk: int
    token: str


@dataclass(frozen=True)
class StoredResponse:
    status: int
    body: Any


def idempotency_key_parse(raw: str) -> str:
    """The key as sent, or a 400 when it is empty, too long or has other characters."""
    if not KEY_PATTERN.match(raw):
        raise HarliError(
            f"The {HEADER} header must be 1-{IDEMPOTENCY_KEY_MAX_LENGTH} characters of "
            "A-Z, a-z, 0-9 and - _ . : ~ + / =.",
            param=HEADER,
            code="invalid_idempotency_key",
        )
    return raw


def request_fingerprint(request: Request) -> str:
    """SHA-256 of the request's method, path and body as parsed (see the module docstring)."""
    digest = hashlib.sha256()
    digest.update(f"{request.method} {request.get_full_path()}\n".encode())
    files = request.FILES
    if files:
        fields = sorted(
            (name, value) for name in request.POST for value in request.POST.getlist(name)
        )
        digest.update(json.dumps(fields).encode())
        for name in sorted(files):
            for upload in files.getlist(name):
                digest.update(f"\nfile {name} {upload.name} {upload.size}\n".encode())
                for chunk in upload.chunks():
                    digest.update(chunk)
                upload.seek(0)
    else:
        data = request.data
        canonical = sorted(data.lists()) if hasattr(data, "lists") else data
        digest.update(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()


def _retention() -> timedelta:
    return timedelta(hours=int(settings.HARLI_IDEMPOTENCY_KEY_RETENTION_H))


def _lock_timeout() -> timedelta:
    return timedelta(seconds=int(settings.HARLI_IDEMPOTENCY_LOCK_S))


def _take(row: IdempotencyKey, *, now: datetime, fresh: bool, **first_use: str) -> Claim:
    """Give the locked `row` a new claim token; `fresh` starts its use over (an expired key)."""
    row.claim = secrets.token_hex(16)
    row.claimed_at = now
    fields = ["claim", "claimed_at"]
    if fresh:
        for name, value in first_use.items():
            setattr(row, name, value)
        row.response_status = None
        row.response_body = None
        row.created_at = now
        row.expires_at = now + _retention()
        fields += [*first_use, "response_status", "response_body", "created_at", "expires_at"]
    row.save(update_fields=fields)
    return Claim(pk=row.pk, token=row.claim)


def idempotency_claim(
    *, tenant: Tenant, key: str, method: str, path: str, fingerprint: str
) -> Claim | StoredResponse:
    """Claim `key` for this request, or the stored response of its first use; raises 422 for
    another request under the key and 409 while the first is in flight. Commits on return."""
    first_use = {"method": method, "path": path, "fingerprint": fingerprint}
    for _ in range(3):  # an insert and a deletion of an expired row may race; retry then
        now = timezone.now()
        try:
            with transaction.atomic():
                row = IdempotencyKey.objects.create(
                    tenant=tenant,
                    key=key,
                    claim=secrets.token_hex(16),
                    claimed_at=now,
                    created_at=now,
                    expires_at=now + _retention(),
                    **first_use,
                )
            return Claim(pk=row.pk, token=row.claim)
        except IntegrityError:
            pass
        with transaction.atomic():
            existing = (
                IdempotencyKey.objects.select_for_update().filter(tenant=tenant, key=key).first()
            )
            if existing is None:
                continue
            if existing.expires_at <= now:
                return _take(existing, now=now, fresh=True, **first_use)
            if existing.fingerprint != fingerprint:
                raise HarliError(
                    f"The {HEADER} {key!r} was used for another request ({existing.method} "
                    f"{existing.path} with another body); use a new key for a new request.",
                    param=HEADER,
                    code="idempotency_key_reused",
                    http_status=422,
                )
            if existing.response_status is not None:
                return StoredResponse(status=existing.response_status, body=existing.response_body)
            if existing.claimed_at <= now - _lock_timeout():
                return _take(existing, now=now, fresh=False)
            raise ConflictError(
                f"A request with {HEADER} {key!r} is still in progress; retry once it finished.",
                param=HEADER,
                code="idempotency_key_in_use",
            )
    raise ConflictError(
        f"The {HEADER} {key!r} is being claimed by another request; retry.",
        param=HEADER,
        code="idempotency_key_in_use",
    )


def idempotency_complete(*, claim: Claim, status: int, body: Any) -> None:
    """Store the response, inside the work's transaction; raises IdempotencyClaimLost (and so
    rolls the work back) when the claim was taken over meanwhile."""
    stored = IdempotencyKey.objects.filter(
        pk=claim.pk, claim=claim.token, response_status__isnull=True
    ).update(response_status=status, response_body=body)
    if stored != 1:
        raise IdempotencyClaimLost(
            f"This request ran longer than {settings.HARLI_IDEMPOTENCY_LOCK_S} s and a retry "
            f"with the same {HEADER} took it over; nothing was done by this one.",
            param=HEADER,
            code="idempotency_key_in_use",
        )


def idempotency_release(*, claim: Claim) -> None:
    """Free the key after a refused or failed request (only while this request holds it)."""
    IdempotencyKey.objects.filter(
        pk=claim.pk, claim=claim.token, response_status__isnull=True
    ).delete()


class _Refused(Exception):
    """Carries a non-2xx response out of the work's transaction, rolling it back."""

    def __init__(self, response: Response) -> None:
        self.response = response


Handler = TypeVar("Handler", bound=Callable[..., Response])


def idempotent(handler: Handler) -> Handler:
    """Apply the module's contract to a tenant view's POST handler (reads `self.tenant`)."""

    @functools.wraps(handler)
    def wrapper(view: Any, request: Request, *args: Any, **kwargs: Any) -> Response:
        raw = request.headers.get(HEADER)
        if raw is None:
            return handler(view, request, *args, **kwargs)
        key = idempotency_key_parse(raw)
        try:
            claimed = idempotency_claim(
                tenant=view.tenant,
                key=key,
                method=str(request.method),
                path=request.path,
                fingerprint=request_fingerprint(request),
            )
        except ConflictError as exc:  # in use: say when to try again
            return Response(exc.body(), status=exc.http_status, headers={"Retry-After": "1"})
        if isinstance(claimed, StoredResponse):
            return Response(claimed.body, status=claimed.status, headers={REPLAYED_HEADER: "true"})
        try:
            with transaction.atomic():
                response = handler(view, request, *args, **kwargs)
                if not 200 <= response.status_code < 300:
                    raise _Refused(response)
                body = json.loads(JSONRenderer().render(response.data) or b"null")
                idempotency_complete(claim=claimed, status=response.status_code, body=body)
        except _Refused as refused:
            idempotency_release(claim=claimed)
            return refused.response
        except BaseException:
            idempotency_release(claim=claimed)
            raise
        return response

    wrapper = extend_schema(parameters=[HEADER_PARAMETER])(wrapper)
    return wrapper  # type: ignore[return-value]
