"""`manage.py hosts register NAME ... | drain NAME | undrain NAME | list | key NAME |
groups NAME | add-group NAME --deployment D [--first-gpu N] | remove-group NAME INDEX`."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import CommandError

from api.management.base import NounCommand
from api.models import HostStatus
from api.selectors import host_list
from api.services.engine_groups import engine_group_add, engine_group_remove
from api.services.fleet import (
    deployment_get,
    host_drain,
    host_get,
    host_register,
    host_undrain,
)
from gpu_runtime.contract.grants import host_key

GIB = 2**30


class Command(NounCommand):
    help = "Register, drain, return to service and list GPU runtime hosts; print a host's key."

    def add_actions(self, subparsers: Any) -> None:
        register = subparsers.add_parser("register", help="register a runtime host")
        register.add_argument("name", help="host name; its Celery queue is host.<name>")
        register.add_argument("--gpu-kind", required=True, help="e.g. H200")
        register.add_argument(
            "--gpu-memory-gb", type=float, required=True, help="memory of one GPU, GiB"
        )
        register.add_argument("--gpu-count", type=int, default=1, help="GPUs driven by the host")
        register.add_argument(
            "--deployment",
            help="a deployment the host serves (engine group 0 from GPU 0; more: add-group)",
        )
        groups = subparsers.add_parser("groups", help="list a host's engine groups")
        groups.add_argument("name")
        add = subparsers.add_parser(
            "add-group", help="serve a deployment in a new engine group of a host"
        )
        add.add_argument("name")
        add.add_argument("--deployment", required=True)
        add.add_argument(
            "--first-gpu",
            type=int,
            help="its first GPU (default: the lowest free range aligned to the group's size)",
        )
        remove = subparsers.add_parser(
            "remove-group", help="stop serving an engine group (refused while jobs run on it)"
        )
        remove.add_argument("name")
        remove.add_argument("index", type=int)
        drain = subparsers.add_parser("drain", help="stop placing new jobs on a host")
        drain.add_argument("name")
        undrain = subparsers.add_parser(
            "undrain", help="return a draining host to service (it takes new jobs again)"
        )
        undrain.add_argument("name")
        key = subparsers.add_parser(
            "key",
            help="print the host's grant key (give it to its agent as HARLI_HOST_KEY or "
            "--host-key-file): the agent accepts only requests the gateway signed with it",
        )
        key.add_argument("name")
        listing = subparsers.add_parser("list", help="list hosts")
        listing.add_argument("--status", choices=HostStatus.values)

    def action_register(
        self,
        *,
        name: str,
        gpu_kind: str,
        gpu_memory_gb: float,
        gpu_count: int,
        deployment: str | None,
        **_: Any,
    ) -> None:
        if gpu_memory_gb <= 0:
            raise CommandError(f"--gpu-memory-gb must be positive, got {gpu_memory_gb}.")
        host = host_register(
            name=name,
            gpu_kind=gpu_kind,
            gpu_memory_bytes=int(gpu_memory_gb * GIB),
            gpu_count=gpu_count,
            deployment=deployment_get(name=deployment) if deployment else None,
        )
        self.stdout.write(
            f"Registered host {host.name} ({host.gpu_count}x {host.gpu_kind}), status "
            f"{host.status}, queue {host.queue_name}."
        )

    def action_groups(self, *, name: str, **_: Any) -> None:
        host = host_get(name=name)
        rows = [
            (g.index, g.deployment.name, g.tensor_parallel_size, g.gpu_range)
            for g in host.engine_groups.select_related("deployment")
        ]
        self.table(["INDEX", "DEPLOYMENT", "TP", "GPUS"], rows)

    def action_add_group(
        self, *, name: str, deployment: str, first_gpu: int | None, **_: Any
    ) -> None:
        group = engine_group_add(
            host=host_get(name=name),
            deployment=deployment_get(name=deployment),
            first_gpu=first_gpu,
        )
        self.stdout.write(
            f"Host {name} serves {deployment} in engine group {group.index} ({group.gpu_range})."
        )

    def action_remove_group(self, *, name: str, index: int, **_: Any) -> None:
        engine_group_remove(host=host_get(name=name), index=index)
        self.stdout.write(f"Removed engine group {index} of host {name}.")

    def action_drain(self, *, name: str, **_: Any) -> None:
        host = host_drain(host=host_get(name=name))
        self.stdout.write(f"Host {host.name} is {host.status}.")

    def action_undrain(self, *, name: str, **_: Any) -> None:
        host = host_undrain(host=host_get(name=name))
        self.stdout.write(f"Host {host.name} is {host.status}.")

    def action_key(self, *, name: str, **_: Any) -> None:
        host = host_get(name=name)
        self.stdout.write(host_key(settings.GATEWAY_SECRET, host.name))

    def action_list(self, *, status: str | None, **_: Any) -> None:
        rows = [
            (
                h.name,
                f"{h.gpu_count}x {h.gpu_kind}",
                f"{h.gpu_memory_bytes / GIB:.0f}",
                _groups(h),
                h.status,
                _engine(h),
                h.last_heartbeat_at.isoformat(timespec="seconds") if h.last_heartbeat_at else None,
                h.predictor_version,
                f"{100 * h.predictor_mape:.1f}%" if h.predictor_mape is not None else None,
                _harvest(h),
            )
            for h in host_list(status=status)
        ]
        self.table(
            ["NAME", "GPUS", "GIB/GPU", "ENGINE GROUPS", "STATUS", "ENGINE", "HEARTBEAT",
             "PREDICTOR", "MAPE", "HARVEST TOK/S"],
            rows,
        )  # fmt: skip


def _engine(host: Any) -> str | None:
    """`harli` or `vllm (no training)`, as its last heartbeat said (None: none yet)."""
    state = getattr(host, "agent_state", None)
    if state is None or not state.capabilities:
        return None
    return state.engine + ("" if state.capabilities.get("colocation") else " (no training)")


def _groups(host: Any) -> str | None:
    """`deployment@GPUs 0-3, other@GPU 4`: what the host's engine groups serve where."""
    groups = list(host.engine_groups.all())
    return ", ".join(f"{g.deployment.name}@{g.gpu_range}" for g in groups) or None


def _harvest(host: Any) -> str | None:
    """The agent's harvestable finetune tokens/s and how it got it ("predictor"/"measured")."""
    state = getattr(host, "agent_state", None)
    if state is None:
        return None
    source = (state.harvest or {}).get("source")
    return f"{state.harvestable_tokens_per_s:.0f}" + (f" ({source})" if source else "")
