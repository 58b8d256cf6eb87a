"""Operator writes: base models, deployments and GPU hosts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import models, transaction

from api.dispatch import host_dispatch
from api.errors import ConflictError, HarliError, NotFoundError
from api.model_shapes import ARCHITECTURE_NAME, base_model_shape, checkpoint_architecture
from api.models import (
    Architecture,
    BaseModel,
    Deployment,
    Dtype,
    Engine,
    GpuHost,
    HostStatus,
)
from api.presets import PRESETS
from api.services.engine_groups import engine_group_add
from gpu_runtime.contract.tensor_parallel import tensor_parallel_problem


def _clean(instance: models.Model, *, kind: str) -> None:
    """Run model validation; raise HarliError naming the first bad field (409 if taken)."""
    try:
        instance.full_clean()
    except DjangoValidationError as exc:
        field, messages = next(iter(exc.message_dict.items()))
        message = "; ".join(messages)
        if "already exists" in message:
            raise ConflictError(f"{kind}: {message}", code=f"{kind}_exists", param=field) from None
        param = None if field == "__all__" else field
        raise HarliError(f"Invalid {kind} {field}: {message}", param=param) from None


@transaction.atomic
def base_model_register(
    *,
    name: str,
    checkpoint_dir: str = "",
    preset: str = "",
    architecture: str | None = None,
    dtype: str = Dtype.BFLOAT16,
    context_length: int | None = None,
) -> BaseModel:
    """Register a base model from a local checkpoint directory or a preset (exactly one).

    With a preset, architecture and context length default to the preset's; with a checkpoint,
    they default to its config.json's (`model_type`, else `architectures[0]`;
    `max_position_embeddings`). The architecture may be any name: one Harli's engine does not
    implement (`Architecture`) can only be served by a vLLM deployment (`deployment_create`).
    """
    if bool(checkpoint_dir) == bool(preset):
        raise HarliError(
            "Give exactly one of a checkpoint directory or a preset.", param="checkpoint_dir"
        )
    config: dict[str, Any] | None = None
    if checkpoint_dir and (architecture is None or context_length is None):
        found_architecture, found_context = checkpoint_architecture(Path(checkpoint_dir))
        architecture = architecture or found_architecture
        context_length = context_length or found_context
    if preset:
        if preset not in PRESETS:
            raise HarliError(
                f"Unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}.",
                param="preset",
                code="unknown_preset",
            )
        spec = PRESETS[preset]
        config = dict(spec.config)
        architecture = architecture or spec.architecture
        context_length = context_length or spec.context_length
    if preset and architecture not in Architecture.values:
        raise HarliError(
            f"A preset's architecture must be one of {', '.join(Architecture.values)}, got "
            f"{architecture!r}.",
            param="architecture",
        )
    if not architecture or not ARCHITECTURE_NAME.match(architecture):
        raise HarliError(
            f"Architecture must be a model type name such as {', '.join(Architecture.values)} "
            f"or mistral, got {architecture!r} (give it explicitly when the checkpoint's "
            "config.json does not name it).",
            param="architecture",
        )
    if context_length is None or context_length < 1:
        raise HarliError(
            f"Context length must be a positive integer, got {context_length!r} (give it "
            "explicitly when the checkpoint's config.json has no max_position_embeddings).",
            param="context_length",
        )
    base_model = BaseModel(
        name=name,
        architecture=architecture,
        checkpoint_dir=checkpoint_dir,
        preset=preset,
        config=config,
        dtype=dtype,
        context_length=context_length,
    )
    _clean(base_model, kind="base_model")
    base_model.save()
    return base_model


def base_model_get(*, name: str) -> BaseModel:
    base_model = BaseModel.objects.filter(name=name).first()
    if base_model is None:
        raise NotFoundError(f"No base model named {name!r}.", param="base_model")
    return base_model


@transaction.atomic
def deployment_create(
    *,
    name: str,
    base_model: BaseModel,
    tpot_slo_ms: float,
    ttft_slo_ms: float,
    slo_attainment_target_pct: float = 99.0,
    tensor_parallel_size: int = 1,
    engine: str = Engine.HARLI,
) -> Deployment:
    """Serve `base_model` under a TPOT/TTFT SLO with an attainment target in percent, sharded
    over `tensor_parallel_size` GPUs per engine group, by `engine`'s hosts.

    A Harli deployment of an architecture the engine does not implement is refused (400,
    param `engine`, code `architecture_needs_vllm`), naming `--engine vllm`.

    The degree must suit the base model's shape (`tensor_parallel_problem`: heads, KV heads and
    the MLP width divide, or KV heads replicate in whole copies); a degree above 1 needs a known
    shape (a stored config, or a checkpoint with a config.json). A bad degree is a HarliError
    (400, param `tensor_parallel_size`) naming the shape; nothing is written.
    """
    _check_engine(base_model, engine)
    _check_tensor_parallel(base_model, tensor_parallel_size)
    deployment = Deployment(
        name=name,
        base_model=base_model,
        tpot_slo_ms=tpot_slo_ms,
        ttft_slo_ms=ttft_slo_ms,
        slo_attainment_target_pct=slo_attainment_target_pct,
        tensor_parallel_size=tensor_parallel_size,
        engine=engine,
    )
    _clean(deployment, kind="deployment")
    deployment.save()
    return deployment


def _check_engine(base_model: BaseModel, engine: str) -> None:
    if engine not in Engine.values:
        raise HarliError(
            f"engine must be one of {', '.join(Engine.values)}, got {engine!r}.", param="engine"
        )
    if engine == Engine.HARLI and base_model.architecture not in Architecture.values:
        raise HarliError(
            f"{base_model.name} is a {base_model.architecture} model, which Harli's engine does "
            f"not implement ({', '.join(Architecture.values)}); it is served by vLLM hosts: "
            'create the deployment with --engine vllm (API: "engine": "vllm").',
            param="engine",
            code="architecture_needs_vllm",
        )


def _check_tensor_parallel(base_model: BaseModel, size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int):
        raise HarliError(
            f"tensor_parallel_size must be an integer, got {size!r}.", param="tensor_parallel_size"
        )
    shape = base_model_shape(base_model)
    if shape is None:
        if size == 1:
            return
        raise HarliError(
            f"Cannot shard {base_model.name} at tensor_parallel_size {size}: its shape is "
            f"unknown (no stored config and no readable config.json in "
            f"{base_model.checkpoint_dir!r}).",
            param="tensor_parallel_size",
        )
    problem = tensor_parallel_problem(shape, size)
    if problem is not None:
        raise HarliError(
            f"{base_model.name} cannot run at tensor_parallel_size {size}: {problem} "
            f"(num_attention_heads {shape.num_attention_heads}, num_key_value_heads "
            f"{shape.num_key_value_heads}, intermediate_size {shape.intermediate_size}).",
            param="tensor_parallel_size",
            code="invalid_tensor_parallel_size",
        )


def deployment_get(*, name: str) -> Deployment:
    deployment = Deployment.objects.filter(name=name).first()
    if deployment is None:
        raise NotFoundError(f"No deployment named {name!r}.", param="deployment")
    return deployment


@transaction.atomic
def host_register(
    *,
    name: str,
    gpu_kind: str,
    gpu_memory_bytes: int,
    gpu_count: int = 1,
    deployment: Deployment | None = None,
) -> GpuHost:
    """Register a runtime host. It starts `offline`; its first heartbeat brings it online.

    With `deployment`, the host serves it in engine group 0 on GPUs 0 ..
    `deployment.tensor_parallel_size - 1` (more groups: `engine_group_add`); a deployment wider
    than the host's `gpu_count` is refused and nothing is written."""
    host = GpuHost(
        name=name,
        gpu_kind=gpu_kind,
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_count=gpu_count,
        status=HostStatus.OFFLINE,
    )
    _clean(host, kind="host")
    host.save()
    if deployment is not None:
        engine_group_add(host=host, deployment=deployment, first_gpu=0)
    return host


def host_get(*, name: str) -> GpuHost:
    host = GpuHost.objects.filter(name=name).first()
    if host is None:
        raise NotFoundError(f"No host named {name!r}.", param="host")
    return host


def _tell_host_on_commit(*, host: GpuHost, command: str) -> None:
    """Send `command` ("drain" or "undrain") to the host's queue once the transaction commits.
    A message the broker does not take is logged; the heartbeats bring the agent in line with
    the host's status anyway (`api.services.reports`)."""

    def send() -> None:
        host_dispatch().host_command_send(host_name=host.name, command=command)

    transaction.on_commit(send, robust=True)


@transaction.atomic
def host_drain(*, host: GpuHost) -> GpuHost:
    """Stop placing new jobs on the host; what runs there finishes. Lost hosts cannot drain.
    Idempotent; `host_undrain` takes it back."""
    locked = GpuHost.objects.select_for_update().get(pk=host.pk)
    if locked.status == HostStatus.LOST:
        raise ConflictError(
            f"Host {locked.name!r} is lost; it cannot drain.", code="host_lost", param="host"
        )
    if locked.status != HostStatus.DRAINING:
        locked.status = HostStatus.DRAINING
        locked.save(update_fields=["status"])
        _tell_host_on_commit(host=locked, command="drain")
    return locked


@transaction.atomic
def host_undrain(*, host: GpuHost) -> GpuHost:
    """Return a draining host to service: it takes new jobs again (`online`, or `offline`
    until its first heartbeat if it never sent one). Idempotent on a host that is not
    draining; a lost host is refused (it comes back with its next heartbeat, still draining
    if its agent is)."""
    locked = GpuHost.objects.select_for_update().get(pk=host.pk)
    if locked.status == HostStatus.LOST:
        raise ConflictError(
            f"Host {locked.name!r} is lost; it returns with its next heartbeat.",
            code="host_lost",
            param="host",
        )
    if locked.status == HostStatus.DRAINING:
        locked.status = HostStatus.ONLINE if locked.last_heartbeat_at else HostStatus.OFFLINE
        locked.save(update_fields=["status"])
        _tell_host_on_commit(host=locked, command="undrain")
    return locked
