"""The control plane's domain models; import them from here (`from api.models import File`)."""

from api.models.agents import (
    HostAdapterAction,
    HostAdapterOrder,
    HostAgentState,
    PlacementDecision,
    ProcessedReport,
)
from api.models.engine_groups import EngineGroup
from api.models.finetune import (
    DEFAULT_LORA_TARGET_MODULES,
    OPEN_PLACEMENT_STATES,
    Adapter,
    EventLevel,
    EventType,
    File,
    FileFormat,
    FilePurpose,
    FileStatus,
    FinetuneJob,
    JobCheckpoint,
    JobEvent,
    JobMethod,
    JobStatus,
    Placement,
    PlacementState,
)
from api.models.fleet import (
    Architecture,
    BaseModel,
    Deployment,
    Dtype,
    Engine,
    GpuHost,
    HostStatus,
)
from api.models.idempotency import IdempotencyKey
from api.models.login import LoginFailure
from api.models.metrics import (
    DeploymentMetric,
    EngineGroupMetric,
    HostMetric,
    JobMetric,
    MetricRollup,
    RollupSeries,
)
from api.models.quotas import TenantQuota, TenantTrainedTokens
from api.models.tenancy import ApiKey, Tenant, User, UserRole
from api.models.uploads import Upload, UploadPart, UploadStatus
from api.models.usage import TenantUsage

__all__ = [
    "RollupSeries",
    "MetricRollup",
    "ProcessedReport",
    "PlacementDecision",
    "HostAgentState",
    "HostAdapterAction",
    "HostAdapterOrder",
    "DEFAULT_LORA_TARGET_MODULES",
    "OPEN_PLACEMENT_STATES",
    "Adapter",
    "ApiKey",
    "Architecture",
    "BaseModel",
    "Deployment",
    "DeploymentMetric",
    "EngineGroup",
    "EngineGroupMetric",
    "Dtype",
    "Engine",
    "EventLevel",
    "EventType",
    "File",
    "FileFormat",
    "JobMethod",
    "FilePurpose",
    "FileStatus",
    "FinetuneJob",
    "GpuHost",
    "HostMetric",
    "HostStatus",
    "IdempotencyKey",
    "JobCheckpoint",
    "JobEvent",
    "JobMetric",
    "JobStatus",
    "LoginFailure",
    "Placement",
    "PlacementState",
    "Tenant",
    "TenantUsage",
    "TenantQuota",
    "TenantTrainedTokens",
    "Upload",
    "UploadPart",
    "UploadStatus",
    "User",
    "UserRole",
]
