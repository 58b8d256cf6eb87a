"""Output shapes of the operator API (plain records of the fleet and of every tenant's jobs)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from api.apis.limits import QuotaSerializer
from api.models import (
    ApiKey,
    BaseModel,
    Deployment,
    EngineGroup,
    FinetuneJob,
    GpuHost,
    Placement,
    Tenant,
)
from api.serializers import JobEventSerializer


class TenantOpsSerializer(serializers.ModelSerializer):
    class Meta:
        model = Tenant
        fields = ["id", "name", "requests_per_minute", "tokens_per_minute", "created_at"]
        extra_kwargs = {
            "requests_per_minute": {"help_text": "inference requests per minute; null: no limit"},
            "tokens_per_minute": {"help_text": "inference tokens per minute; null: no limit"},
        }


class TenantQuotasPatchSerializer(serializers.Serializer):
    """Quota overrides in a tenant's PATCH (`api.quotas`): an integer from 0, or null for the
    fleet default."""

    running_jobs = serializers.IntegerField(allow_null=True, required=False, min_value=0)
    queued_jobs = serializers.IntegerField(allow_null=True, required=False, min_value=0)
    stored_bytes = serializers.IntegerField(allow_null=True, required=False, min_value=0)
    trained_tokens_per_month = serializers.IntegerField(
        allow_null=True, required=False, min_value=0
    )


class TenantDetailOpsSerializer(TenantOpsSerializer):
    """A tenant with each quota: its limit, the default, the override and current use."""

    quotas = QuotaSerializer(many=True, read_only=True)

    class Meta(TenantOpsSerializer.Meta):
        fields = [*TenantOpsSerializer.Meta.fields, "quotas"]


class ApiKeyOpsSerializer(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username")
    role = serializers.CharField(source="user.role")
    tenant = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "prefix",
            "name",
            "username",
            "role",
            "tenant",
            "created_at",
            "last_used_at",
            "revoked_at",
        ]

    def get_tenant(self, api_key: ApiKey) -> str | None:
        tenant = api_key.user.tenant
        return tenant.name if tenant is not None else None


class BaseModelOpsSerializer(serializers.ModelSerializer):
    class Meta:
        model = BaseModel
        fields = [
            "id",
            "name",
            "architecture",
            "checkpoint_dir",
            "preset",
            "config",
            "dtype",
            "context_length",
            "created_at",
        ]


class DeploymentOpsSerializer(serializers.ModelSerializer):
    base_model = serializers.CharField(source="base_model.name")

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "base_model",
            "tpot_slo_ms",
            "ttft_slo_ms",
            "slo_attainment_target_pct",
            "tensor_parallel_size",
            "engine",
            "created_at",
        ]


class EngineGroupOpsSerializer(serializers.ModelSerializer):
    host = serializers.CharField(source="host.name")
    deployment = serializers.CharField(source="deployment.name")
    tensor_parallel_size = serializers.IntegerField(
        help_text="GPUs the group shards its deployment over"
    )
    gpu_indices = serializers.ListField(
        child=serializers.IntegerField(), help_text="the host's GPUs it drives, in rank order"
    )

    class Meta:
        model = EngineGroup
        fields = [
            "host",
            "index",
            "deployment",
            "tensor_parallel_size",
            "first_gpu",
            "gpu_indices",
            "created_at",
        ]


class GpuHostOpsSerializer(serializers.ModelSerializer):
    deployment = serializers.SerializerMethodField(
        help_text="the deployment of engine group 0 (null: none); all groups: `engine_groups`"
    )
    engine_groups = serializers.SerializerMethodField()
    queue_name = serializers.CharField()
    harvestable_tokens_per_s = serializers.SerializerMethodField(
        help_text="The agent's estimate of the finetune tokens/s it can harvest (last heartbeat)."
    )
    harvest = serializers.SerializerMethodField(
        help_text='How: `source` "predictor" (its latency predictor) or "measured", and inputs.'
    )
    engine = serializers.SerializerMethodField(
        help_text='The engine its last heartbeat named, "harli" or "vllm" (null: none yet).'
    )
    capabilities = serializers.SerializerMethodField(
        help_text="What it can do (last heartbeat): colocation (can train), architectures, "
        "max_loras, max_lora_rank, and engine_state (a vLLM host's server state, restarts)."
    )

    class Meta:
        model = GpuHost
        fields = [
            "id",
            "name",
            "gpu_kind",
            "gpu_count",
            "gpu_memory_bytes",
            "deployment",
            "engine_groups",
            "status",
            "last_heartbeat_at",
            "predictor_version",
            "predictor_mape",
            "harvestable_tokens_per_s",
            "harvest",
            "engine",
            "capabilities",
            "queue_name",
            "created_at",
        ]

    def get_deployment(self, host: GpuHost) -> str | None:
        groups = list(host.engine_groups.all())
        return groups[0].deployment.name if groups else None

    @extend_schema_field(EngineGroupOpsSerializer(many=True))
    def get_engine_groups(self, host: GpuHost) -> list[dict[str, Any]]:
        groups = list(host.engine_groups.all())
        for group in groups:
            group.host = host  # the prefetched rows' host, not another query
        return list(EngineGroupOpsSerializer(groups, many=True).data)

    def get_harvestable_tokens_per_s(self, host: GpuHost) -> float | None:
        state = getattr(host, "agent_state", None)
        return float(state.harvestable_tokens_per_s) if state is not None else None

    def get_harvest(self, host: GpuHost) -> dict[str, Any] | None:
        state = getattr(host, "agent_state", None)
        return dict(state.harvest or {}) if state is not None else None

    def get_engine(self, host: GpuHost) -> str | None:
        state = getattr(host, "agent_state", None)
        return str(state.engine) if state is not None and state.reported_at else None

    @extend_schema_field(serializers.DictField(allow_null=True))
    def get_capabilities(self, host: GpuHost) -> dict[str, Any] | None:
        state = getattr(host, "agent_state", None)
        if state is None or not state.capabilities:
            return None
        return dict(state.capabilities) | {"engine_state": dict(state.engine_state or {})}


class PlacementOpsSerializer(serializers.ModelSerializer):
    job = serializers.CharField(source="job_id")
    host = serializers.CharField(source="host.name")
    engine_group = serializers.IntegerField(
        source="engine_group.index",
        allow_null=True,
        default=None,
        help_text="the index of the host's engine group that trains it (null: none recorded)",
    )

    class Meta:
        model = Placement
        fields = [
            "id",
            "job",
            "host",
            "engine_group",
            "state",
            "created_at",
            "started_at",
            "ended_at",
        ]


class FinetuneJobOpsSerializer(serializers.ModelSerializer):
    tenant = serializers.CharField(source="tenant.name")
    base_model = serializers.CharField(source="base_model.name")
    training_file = serializers.CharField(source="training_file_id")
    validation_file = serializers.CharField(source="validation_file_id", allow_null=True)

    class Meta:
        model = FinetuneJob
        fields = [
            "id",
            "tenant",
            "base_model",
            "status",
            "training_file",
            "validation_file",
            "hyperparameters",
            "lora_rank",
            "lora_alpha",
            "lora_dropout",
            "lora_target_modules",
            "suffix",
            "seed",
            "trained_tokens",
            "fine_tuned_model",
            "error",
            "created_at",
            "started_at",
            "finished_at",
        ]


class JobEventOpsSerializer(JobEventSerializer):
    """A job event as the tenant sees it, plus its host-level `fleet_detail` (operators only)."""

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        fields["fleet_detail"] = serializers.JSONField(
            allow_null=True,
            help_text="host-level detail: `text` (the event naming its host), `host`, ...",
        )
        return fields
