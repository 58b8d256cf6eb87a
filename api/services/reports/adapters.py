"""`adapter_load_failed`: a host could not apply a `load_adapter` command; the failure is
recorded on the host's order for that model (`api.services.host_adapters`), where operators
read it (`manage.py host_adapter list`, `GET /api/ops/hosts/<name>/adapters`)."""

from __future__ import annotations

import logging
from typing import Any

from api.models import GpuHost
from api.services.host_adapters import host_adapter_load_failed

logger = logging.getLogger(__name__)


def adapter_load_failed_apply(*, host: GpuHost, message: dict[str, Any]) -> str:
    name, text = str(message["name"]), str(message["message"])
    host_adapter_load_failed(host=host, name=name, message=text)
    logger.warning("host %s cannot serve %s: %s", host.name, name, text)
    return "applied"
