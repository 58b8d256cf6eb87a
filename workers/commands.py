"""The control plane's messaging: commands to a host's queue `host.<name>` (formats in
`gpu_runtime.contract.protocol`) and the placement task, behind `api.dispatch.HostDispatch`.

Every sender here publishes; callers run it from `transaction.on_commit` so a host never hears
of a row that was rolled back. Every command is signed with its host's message key
(`workers.message_keys`); the agent drops one that is not.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from kombu.exceptions import OperationalError as BrokerOperationalError

from config.celery import app
from gpu_runtime.contract.message_auth import message_sign
from gpu_runtime.contract.protocol import HOST_COMMAND_TASK, check_command, host_queue
from gpu_runtime.contract.request_id import current_request_id
from workers.message_keys import host_message_key
from workers.tasks import place_job

logger = logging.getLogger(__name__)


def send_host_command(*, host_name: str, command: str, **fields: Any) -> dict[str, Any]:
    """Publish one command to `host.<host_name>`, signed with its key; returns the message
    sent. It carries the id of the request (or task) that caused it as `request_id`, where there
    is one (signed with the rest)."""
    request_id = current_request_id()
    message = check_command(
        {"command": command, "command_id": uuid.uuid4().hex, **fields}
        | ({"request_id": request_id} if request_id is not None else {})
    )
    message = message_sign(message, host_message_key(host_name))
    app.send_task(
        HOST_COMMAND_TASK,
        args=[message],
        queue=host_queue(host_name),
        routing_key=host_queue(host_name),
        retry=True,
        retry_policy={"max_retries": 5, "interval_start": 0.2, "interval_step": 0.5},
    )
    logger.info("sent %s %s to host %s", command, message["command_id"], host_name)
    return message


def send_stop(*, host_name: str, placement_id: int, job_id: str, command: str) -> bool:
    """Tell a host to pause or cancel a placement; False (logged) when the broker did not take
    the message. Nothing is lost then: while the host still trains the placement, its
    heartbeats name it, and the stale-placement check (`api.services.reports`) sends the stop again.
    """
    try:
        send_host_command(
            host_name=host_name, command=command, placement_id=placement_id, job_id=job_id
        )
    except (BrokerOperationalError, OSError) as exc:
        logger.warning(
            "%s of job %s (placement %s) not sent to host %s: %s; its next heartbeat will stop it",
            command,
            job_id,
            placement_id,
            host_name,
            exc,
        )
        return False
    logger.info("sent %s of job %s (placement %s) to host %s", command, job_id, placement_id,
                host_name)  # fmt: skip
    return True


def send_unload(*, host_name: str, name: str) -> bool:
    """Tell a host to stop serving model `name`; False (logged) when the broker did not take
    it. While the host still serves it, its heartbeats name it and the heartbeat handler
    (`api.services.reports.heartbeat`) sends the unload again."""
    try:
        send_host_command(host_name=host_name, command="unload_adapter", name=name)
    except (BrokerOperationalError, OSError) as exc:
        logger.warning("unload of %s not sent to host %s: %s; its next heartbeat will", name,
                       host_name, exc)  # fmt: skip
        return False
    return True


class CeleryHostDispatch:
    """`api.dispatch.HostDispatch` over the control plane's Celery app."""

    def job_place_queue(self, *, job_id: str) -> None:
        place_job.delay(job_id)

    def host_command_send(self, *, host_name: str, command: str, **fields: Any) -> dict[str, Any]:
        return send_host_command(host_name=host_name, command=command, **fields)

    def placement_stop_send(
        self, *, host_name: str, placement_id: int, job_id: str, command: str
    ) -> bool:
        return send_stop(
            host_name=host_name, placement_id=placement_id, job_id=job_id, command=command
        )

    def model_unload_send(self, *, host_name: str, name: str) -> bool:
        return send_unload(host_name=host_name, name=name)
