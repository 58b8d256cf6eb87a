"""Celery tasks of the control plane: thin, id- or message-based, idempotent.

Every task: `acks_late` (a task lost with its worker runs again), retries only for transient
database/broker errors (`autoretry_for`), soft and hard time limits. Idempotence: placement
skips jobs already placed; host reports are deduplicated by message id; reconciliation only
moves rows whose state still calls for it; the upload sweep only expires uploads still pending;
the janitor removes only what is past its age or retention, so a repeated pass finds nothing.
Host reports are counted by kind and outcome, placement and reconciliation timed
(`workers.metrics`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from django.db import InterfaceError, OperationalError
from kombu.exceptions import OperationalError as BrokerOperationalError

from api.services.janitor import janitor_sweep
from api.services.placement import job_place
from api.services.reconcile import fleet_reconcile
from api.services.reports import host_report_apply
from api.services.uploads import upload_expire_due
from config.celery import app
from gpu_runtime.contract.message_auth import MessageAuthError, message_verify
from gpu_runtime.contract.protocol import HOST_REPORT_TASK, ProtocolError
from workers.message_keys import host_message_key
from workers.metrics import (
    PLACEMENT_DURATION,
    RECONCILE_DURATION,
    host_report_count,
    timed,
)

logger = logging.getLogger(__name__)

PERIODIC_REPORTS = frozenset({"heartbeat", "metrics"})
TRANSIENT = (OperationalError, InterfaceError, BrokerOperationalError, ConnectionError)
COMMON: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "autoretry_for": TRANSIENT,
    "retry_backoff": 0.5,
    "retry_backoff_max": 10,
    "retry_jitter": True,
    "max_retries": 8,
}


@app.task(name="workers.place_job", soft_time_limit=30, time_limit=60, **COMMON)
def place_job(job_id: str) -> int | None:
    """Place a queued job; returns the placement id, or None (placed already / no host fits)."""
    with timed(PLACEMENT_DURATION, outcome="not_placed") as labels:
        placement = job_place(job_id=job_id)
        if placement is not None:
            labels["outcome"] = "placed"
    return placement.pk if placement is not None else None


def _verified(message: Any) -> dict[str, Any]:
    """`message` without its signature when its `host`'s key signed it; MessageAuthError."""
    host = message.get("host") if isinstance(message, dict) else None
    if not isinstance(host, str) or not host:
        raise MessageAuthError("the report names no host, so no key verifies it")
    try:
        key = host_message_key(host)
    except ValueError as exc:  # no gateway secret: no key verifies anything
        raise MessageAuthError(f"no key for host {host!r}: {exc}") from exc
    return message_verify(message, key)


@app.task(name=HOST_REPORT_TASK, soft_time_limit=30, time_limit=60, **COMMON)
def host_report(message: Any) -> str:
    """Apply one report from a host agent (`api.services.reports`) once its signature verifies
    under its host's key; unsigned, forged or altered ones ("unauthenticated") and malformed
    ones ("malformed") are logged at ERROR and dropped, nothing of them stored or forwarded.
    Each is logged under the request id of the command it answers (`config.celery_request_ids`);
    heartbeats and metrics at DEBUG, and counted by kind and outcome (`workers.metrics`)."""
    kind = message.get("kind") if isinstance(message, dict) else None
    try:
        verified = _verified(message)
    except MessageAuthError as exc:
        host = message.get("host") if isinstance(message, dict) else None
        message_id = message.get("message_id") if isinstance(message, dict) else None
        logger.error("dropping unauthenticated host report (host %r, message %r): %s",
                     host, message_id, exc)  # fmt: skip
        host_report_count(kind, "unauthenticated")
        return "unauthenticated"
    try:
        outcome = host_report_apply(message=verified)
    except ProtocolError as exc:
        logger.error("dropping malformed host report: %s", exc)
        host_report_count(kind, "malformed")
        return "malformed"
    except Exception:
        host_report_count(kind, "error")
        raise
    host_report_count(kind, outcome)
    level = logging.DEBUG if kind in PERIODIC_REPORTS else logging.INFO
    logger.log(level, "host %s reported %s: %s", message.get("host"), kind, outcome,
               extra={"host": message.get("host"), "report": kind,
                      "outcome": outcome})  # fmt: skip
    return outcome


@app.task(name="workers.reconcile", soft_time_limit=60, time_limit=120, **COMMON)
def reconcile_fleet() -> dict[str, Any]:
    """One reconciliation pass (`api.services.reconcile`)."""
    with timed(RECONCILE_DURATION):
        result = fleet_reconcile()
    return asdict(result)


@app.task(name="workers.expire_uploads", soft_time_limit=60, time_limit=120, **COMMON)
def expire_uploads() -> list[str]:
    """Expire pending uploads past `expires_at`, dropping their parts; returns their ids."""
    return upload_expire_due()


@app.task(name="workers.janitor", soft_time_limit=300, time_limit=600, **COMMON)
def janitor() -> dict[str, Any]:
    """One pass of the janitor (`api.services.janitor`): crash litter and retention pruning."""
    result = janitor_sweep()
    swept = asdict(result)
    logger.info(
        "janitor: %s",
        ", ".join(f"{name}={len(v) if isinstance(v, list) else v}" for name, v in swept.items()),
    )
    return swept
