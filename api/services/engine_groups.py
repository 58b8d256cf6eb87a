"""Operator writes on engine groups: which deployment runs on which GPUs of a host.

Rules (`api.models.engine_groups`): a group covers GPUs `first_gpu .. first_gpu +
deployment.tensor_parallel_size - 1`, inside `0 .. host.gpu_count - 1`, and shares no GPU with
another group of its host. Both are checked under the host's row lock, so two concurrent adds
cannot overlap; the database also refuses two groups with one index or one first GPU. A group
with an open (pending or active) placement cannot be removed: drain it first (pause or cancel
its jobs, or let them finish). Errors name the ranges; nothing is written on an error.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction

from api.errors import ConflictError, HarliError, NotFoundError
from api.models import OPEN_PLACEMENT_STATES, Deployment, EngineGroup, GpuHost, Placement


def _range_text(first: int, size: int) -> str:
    return f"GPU {first}" if size == 1 else f"GPUs {first}-{first + size - 1}"


def _first_free(host: GpuHost, groups: list[EngineGroup], size: int) -> int:
    """The lowest first GPU where `size` GPUs are free, aligned to `size`; HarliError when
    none is (naming what the groups hold)."""
    taken = {gpu for g in groups for gpu in g.gpu_indices}
    for first in range(0, host.gpu_count - size + 1, size):
        if not taken & set(range(first, first + size)):
            return first
    held = ", ".join(f"group {g.index}: {g.gpu_range}" for g in groups) or "none"
    raise ConflictError(
        f"Host {host.name} has no {size} free GPUs in a row for a tensor_parallel_size {size} "
        f"group ({host.gpu_count} GPUs; held: {held}).",
        param="first_gpu",
        code="no_free_gpus",
    )


def engine_group_check(
    *, host: GpuHost, groups: list[EngineGroup], first_gpu: int, size: int
) -> None:
    """Raise HarliError when GPUs `first_gpu .. first_gpu + size - 1` fall outside the host or
    overlap one of `groups` (the host's other groups)."""
    wanted = _range_text(first_gpu, size)
    if first_gpu < 0 or first_gpu + size > host.gpu_count:
        raise HarliError(
            f"A tensor_parallel_size {size} group at {wanted} does not fit host {host.name}, "
            f"whose GPUs are 0-{host.gpu_count - 1}.",
            param="first_gpu",
            code="gpus_out_of_range",
        )
    mine = set(range(first_gpu, first_gpu + size))
    for group in groups:
        if mine & set(group.gpu_indices):
            raise ConflictError(
                f"{wanted} overlap engine group {group.index} of host {host.name} "
                f"({group.deployment.name}, {group.gpu_range}).",
                param="first_gpu",
                code="gpus_overlap",
            )


@transaction.atomic
def engine_group_add(
    *, host: GpuHost, deployment: Deployment, first_gpu: int | None = None
) -> EngineGroup:
    """Serve `deployment` on `host` in a new group at `first_gpu` (default: the lowest free
    range aligned to the deployment's degree); its index is one past the host's highest."""
    locked = GpuHost.objects.select_for_update().get(pk=host.pk)
    groups = list(EngineGroup.objects.filter(host=locked).select_related("deployment"))
    size = int(deployment.tensor_parallel_size)
    if first_gpu is None:
        first_gpu = _first_free(locked, groups, size)
    engine_group_check(host=locked, groups=groups, first_gpu=first_gpu, size=size)
    index = max((g.index for g in groups), default=-1) + 1
    try:
        with transaction.atomic():
            return EngineGroup.objects.create(
                host=locked, deployment=deployment, index=index, first_gpu=first_gpu
            )
    except IntegrityError:  # a concurrent writer without the lock (never ours)
        raise ConflictError(
            f"Host {locked.name} changed meanwhile; try again.", code="engine_group_conflict"
        ) from None


def engine_group_get(*, host: GpuHost, index: int) -> EngineGroup:
    group = (
        EngineGroup.objects.select_related("deployment", "host")
        .filter(host=host, index=index)
        .first()
    )
    if group is None:
        raise NotFoundError(f"Host {host.name} has no engine group {index}.", param="index")
    return group


@transaction.atomic
def engine_group_remove(*, host: GpuHost, index: int) -> None:
    """Stop serving engine group `index` of `host`; refused (409) while a placement on it is
    open. Its closed placements and decode metrics keep their rows, without the group."""
    locked = GpuHost.objects.select_for_update().get(pk=host.pk)
    group = engine_group_get(host=locked, index=index)
    open_ids = list(
        Placement.objects.filter(engine_group=group, state__in=OPEN_PLACEMENT_STATES)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    if open_ids:
        raise ConflictError(
            f"Engine group {index} of host {locked.name} ({group.deployment.name}, "
            f"{group.gpu_range}) has open placements {open_ids}; pause or cancel their jobs "
            "(or wait for them) first.",
            param="index",
            code="engine_group_busy",
        )
    group.delete()
