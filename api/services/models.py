"""Deleting a tenant's fine-tuned models (`DELETE /v1/models/{model}`, OpenAI's shape).

A fine-tuned model is a finished adapter (the job's `fine_tuned_model`) or one of a job's
checkpoints (its `fine_tuned_model_checkpoint`); each is deleted on its own, as OpenAI's
checkpoints are models of their own. Deleting removes the row now; the job keeps its
`fine_tuned_model` name and gets an event. After the commit the stored weights are removed and
every host that may serve the model is told to unload it (`unload_adapter`); a host that misses
the message unloads it when its next heartbeat names it (`api.services.reports.heartbeat`), and
its server refuses the name as soon as the control plane does. Base models cannot be deleted.
"""

from __future__ import annotations

import logging
from functools import partial

from django.db import transaction

from api.dispatch import host_dispatch
from api.errors import ConflictError, HarliError, NotFoundError
from api.models import Adapter, BaseModel, GpuHost, HostAgentState, JobCheckpoint, Tenant
from api.selectors import adapter_find, checkpoint_model_find
from api.services.jobs import job_event_record
from api.storage import get_storage
from api.transitions import TERMINAL_STATUSES

logger = logging.getLogger(__name__)


def fine_tuned_model_delete(*, tenant: Tenant, model_id: str) -> None:
    """Delete the tenant's adapter or checkpoint named `model_id` (see the module docstring).

    Raises HarliError 403 for a base model, NotFoundError for anything the tenant does not own
    (another tenant's model reads as nonexistent), ConflictError for a checkpoint of a job
    that has not ended (it may still resume from it).
    """
    if BaseModel.objects.filter(name=model_id).exists():
        raise HarliError(
            f"The model {model_id!r} is a base model; only fine-tuned models can be deleted.",
            param="model",
            code="model_not_deletable",
            http_status=403,
        )
    with transaction.atomic():
        adapter = adapter_find(tenant=tenant, model_id=model_id)
        if adapter is not None:
            locked = Adapter.objects.select_for_update().filter(pk=adapter.pk).first()
            if locked is None:  # deleted by a concurrent call
                raise NotFoundError(f"The model {model_id!r} does not exist.", param="model")
            storage_key, base_model_id, job = locked.path, locked.base_model_id, adapter.job
            locked.delete()
            message = f"Fine-tuned model deleted: {model_id}"
        else:
            checkpoint = checkpoint_model_find(tenant=tenant, model_id=model_id)
            if checkpoint is None:
                raise NotFoundError(f"The model {model_id!r} does not exist.", param="model")
            job = checkpoint.job
            if job.status not in TERMINAL_STATUSES:
                raise ConflictError(
                    f"Job {job.id} is {job.status} and may resume from this checkpoint; "
                    "delete it once the job has ended.",
                    param="model",
                    code="checkpoint_in_use",
                )
            deleted, _ = JobCheckpoint.objects.filter(pk=checkpoint.pk).delete()
            if not deleted:
                raise NotFoundError(f"The model {model_id!r} does not exist.", param="model")
            storage_key, base_model_id = checkpoint.path, job.base_model_id
            message = f"Checkpoint model deleted: {model_id}"
        job_event_record(job=job, message=message)
        retire = partial(
            fine_tuned_model_retire,
            name=model_id,
            storage_key=storage_key,
            base_model_id=base_model_id,
        )
        transaction.on_commit(retire, robust=True)


def fine_tuned_model_retire(*, name: str, storage_key: str, base_model_id: int) -> None:
    """After a deletion commits: remove its stored tree (so no host can fetch it again), then
    tell the hosts to unload `name`."""
    if storage_key:
        get_storage().delete_tree(storage_key)
    hosts = _unload_everywhere(name=name, base_model_id=base_model_id)
    logger.info("deleted model %s; unload sent to %s", name, ", ".join(hosts) or "no host")


def _unload_everywhere(*, name: str, base_model_id: int) -> list[str]:
    """Send `unload_adapter` for `name` to every host that may serve it: each host of a
    engine group serving its base model, and any other host whose last heartbeat named it. Returns
    the host names, sorted."""
    hosts = set(
        GpuHost.objects.filter(engine_groups__deployment__base_model_id=base_model_id).values_list(
            "name", flat=True
        )
    )
    for state in HostAgentState.objects.select_related("host"):
        if name in (state.adapters or []):
            hosts.add(state.host.name)
    for host_name in sorted(hosts):
        host_dispatch().model_unload_send(host_name=host_name, name=name)
    return sorted(hosts)
