"""An operator loads or unloads a fine-tuned model on one host, without restarting it.

:func:`host_adapter_load` records the operator's `load` order and, once it commits, sends the
host the signed `load_adapter` command with the model's stored tree (a finished adapter, or a
job's checkpoint); :func:`host_adapter_unload` records `unload` and sends `unload_adapter`.
The host answers a load it cannot apply with an `adapter_load_failed` report
(:func:`host_adapter_load_failed`, recorded on the order), and a load it applied shows in its
next heartbeat's `adapters` (which clears a recorded failure). An `unload` order keeps the
heartbeats from offering the model to that host again (`api.services.reports.heartbeat`);
a later `load` lifts it.

Refusals: an unknown host or model is a NotFoundError (404, `host` / `model`); a model whose
base model is not the one the host reports serving is a ConflictError (409,
`base_model_mismatch`), as is a load on a host that has not reported yet (`host_not_reported`)
or of a model with no stored weights (`model_not_stored`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import partial

from django.db import transaction
from django.utils import timezone

from api.dispatch import host_dispatch
from api.errors import ConflictError, NotFoundError
from api.models import (
    Adapter,
    GpuHost,
    HostAdapterAction,
    HostAdapterOrder,
    HostAgentState,
    JobCheckpoint,
)
from api.selectors import fine_tuned_model_name
from api.services.fleet import host_get
from gpu_runtime.contract.protocol import parse_checkpoint_model


@dataclass(frozen=True)
class StoredModel:
    """A fine-tuned model's stored tree and the base model it was trained on."""

    name: str
    storage_key: str
    base_model: str


def stored_model_find(*, name: str) -> StoredModel | None:
    """The finished adapter or job checkpoint named `name` (any tenant's), or None."""
    adapter = Adapter.objects.select_related("base_model").filter(name=name).first()
    if adapter is not None:
        return StoredModel(name, adapter.path, adapter.base_model.name)
    parsed = parse_checkpoint_model(name)
    if parsed is None:
        return None
    model, job_id, step = parsed
    checkpoint = (
        JobCheckpoint.objects.select_related("job__tenant", "job__base_model")
        .filter(job_id=job_id, step=step)
        .first()
    )
    if checkpoint is None or fine_tuned_model_name(job=checkpoint.job) != model:
        return None
    return StoredModel(name, checkpoint.path, checkpoint.job.base_model.name)


def _order(*, host: GpuHost, name: str, action: str) -> HostAdapterOrder:
    order, _ = HostAdapterOrder.objects.update_or_create(
        host=host, name=name, defaults={"action": action}
    )
    return order


@transaction.atomic
def host_adapter_load(*, host_name: str, model: str) -> HostAdapterOrder:
    """Order `host_name` to serve `model` (see the module docstring for the refusals)."""
    host = host_get(name=host_name)
    stored = stored_model_find(name=model)
    if stored is None:
        raise NotFoundError(f"No fine-tuned model named {model!r}.", param="model")
    if not stored.storage_key:
        raise ConflictError(f"The model {model!r} has no stored weights.", param="model",
                            code="model_not_stored")  # fmt: skip
    state = HostAgentState.objects.filter(host=host).first()
    if state is None or not state.base_model:
        raise ConflictError(
            f"Host {host.name!r} has not reported the base model it serves yet.",
            param="host", code="host_not_reported",
        )  # fmt: skip
    if state.base_model != stored.base_model:
        raise ConflictError(
            f"Host {host.name!r} serves base model {state.base_model!r}; {model!r} is an "
            f"adapter of {stored.base_model!r}.",
            param="model", code="base_model_mismatch",
        )  # fmt: skip
    order = _order(host=host, name=model, action=HostAdapterAction.LOAD)
    send = partial(host_dispatch().host_command_send, host_name=host.name,
                   command="load_adapter", name=model, storage_key=stored.storage_key)  # fmt: skip
    transaction.on_commit(send, robust=True)
    return order


@transaction.atomic
def host_adapter_unload(*, host_name: str, model: str) -> HostAdapterOrder:
    """Order `host_name` to stop serving `model`: a fine-tuned model the control plane has, or
    any name the host's last heartbeat listed (one an operator loaded on the host itself);
    NotFoundError otherwise. Requests already running with it finish on the host."""
    host = host_get(name=host_name)
    state = HostAgentState.objects.filter(host=host).first()
    served = state is not None and model in (state.adapters or [])
    if not served and stored_model_find(name=model) is None:
        raise NotFoundError(
            f"No fine-tuned model named {model!r}, and host {host.name!r} does not serve it.",
            param="model",
        )
    order = _order(host=host, name=model, action=HostAdapterAction.UNLOAD)
    send = partial(host_dispatch().model_unload_send, host_name=host.name, name=model)
    transaction.on_commit(send, robust=True)
    return order


def host_adapter_load_failed(*, host: GpuHost, name: str, message: str) -> HostAdapterOrder:
    """Record the host's failure to load `name` (its `adapter_load_failed` report) on the
    order, creating a `load` order when none exists (the heartbeats asked for the load)."""
    order, _ = HostAdapterOrder.objects.update_or_create(
        host=host,
        name=name,
        defaults={"failure": message[:1000], "failed_at": timezone.now()},
        create_defaults={
            "action": HostAdapterAction.LOAD,
            "failure": message[:1000],
            "failed_at": timezone.now(),
        },  # fmt: skip
    )
    return order


def host_adapter_served(*, host: GpuHost, served: set[str]) -> None:
    """A heartbeat named `served`: the recorded load failures of those names are over."""
    if served:
        HostAdapterOrder.objects.filter(host=host, name__in=served).exclude(failure="").update(
            failure="", failed_at=None
        )


def host_adapter_unloaded_names(*, host: GpuHost) -> set[str]:
    """The names an operator ordered off `host` (the heartbeats do not offer them again)."""
    orders = HostAdapterOrder.objects.filter(host=host, action=HostAdapterAction.UNLOAD)
    return set(orders.values_list("name", flat=True))


@dataclass(frozen=True)
class HostAdapterEntry:
    """One model on a host's list: served (its last heartbeat named it), an operator's order
    about it, or both."""

    name: str
    served: bool
    order: str | None
    """The operator's last order ("load" | "unload"), None without one."""
    failure: str
    """The host's latest failure to load it ("" when none since it was last served)."""
    failed_at: datetime | None


def host_adapter_list(*, host_name: str) -> list[HostAdapterEntry]:
    """What `host_name` serves and what operators ordered about it, sorted by name (a read:
    nothing is sent)."""
    host = host_get(name=host_name)
    state = HostAgentState.objects.filter(host=host).first()
    served = set(state.adapters or []) if state is not None else set()
    orders = {o.name: o for o in HostAdapterOrder.objects.filter(host=host)}
    return [
        HostAdapterEntry(
            name=name,
            served=name in served,
            order=orders[name].action if name in orders else None,
            failure=orders[name].failure if name in orders else "",
            failed_at=orders[name].failed_at if name in orders else None,
        )
        for name in sorted(served | set(orders))
    ]
