"""Routes of the tenant API (`/v1`, namespace `v1`) and the operator API (`/api/ops/`, `ops`).

Tenant routes have no trailing slash, as OpenAI's; the official client builds them that way.
"""

from __future__ import annotations

from django.urls import URLPattern, path

from api.apis import (
    adapters,
    files,
    jobs,
    limits,
    models,
    ops,
    ops_engine_groups,
    ops_host_adapters,
    ops_usage,
    uploads,
    usage,
)

JOB = "fine_tuning/jobs/<str:fine_tuning_job_id>"
UPLOAD = "uploads/<str:upload_id>"

v1_urlpatterns: list[URLPattern] = [
    path("files", files.FileCollectionApi.as_view(), name="files"),
    path("files/<str:file_id>", files.FileDetailApi.as_view(), name="file"),
    path("files/<str:file_id>/content", files.FileContentApi.as_view(), name="file-content"),
    path("uploads", uploads.UploadCollectionApi.as_view(), name="uploads"),
    path(f"{UPLOAD}/parts", uploads.UploadPartsApi.as_view(), name="upload-parts"),
    path(f"{UPLOAD}/complete", uploads.UploadCompleteApi.as_view(), name="upload-complete"),
    path(f"{UPLOAD}/cancel", uploads.UploadCancelApi.as_view(), name="upload-cancel"),
    path("fine_tuning/jobs", jobs.JobCollectionApi.as_view(), name="jobs"),
    path(JOB, jobs.JobDetailApi.as_view(), name="job"),
    path(f"{JOB}/cancel", jobs.JobCancelApi.as_view(), name="job-cancel"),
    path(f"{JOB}/pause", jobs.JobPauseApi.as_view(), name="job-pause"),
    path(f"{JOB}/resume", jobs.JobResumeApi.as_view(), name="job-resume"),
    path(f"{JOB}/events", jobs.JobEventsApi.as_view(), name="job-events"),
    path(f"{JOB}/checkpoints", jobs.JobCheckpointsApi.as_view(), name="job-checkpoints"),
    path(
        f"{JOB}/checkpoints/<str:checkpoint_id>/content",
        adapters.JobCheckpointContentApi.as_view(),
        name="job-checkpoint-content",
    ),
    path("models", models.ModelCollectionApi.as_view(), name="models"),
    path("models/<str:model>", models.ModelDetailApi.as_view(), name="model"),
    path("models/<str:model>/content", adapters.ModelContentApi.as_view(), name="model-content"),
    path(
        "organization/usage/completions",
        usage.UsageCompletionsApi.as_view(),
        name="usage-completions",
    ),
    path("organization/limits", limits.OrganizationLimitsApi.as_view(), name="organization-limits"),
]

ops_urlpatterns: list[URLPattern] = [
    path("tenants", ops.TenantsApi.as_view(), name="tenants"),
    path("tenants/<str:name>", ops.TenantDetailApi.as_view(), name="tenant"),
    path("apikeys", ops.ApiKeysApi.as_view(), name="apikeys"),
    path("apikeys/<int:key_id>/revoke", ops.ApiKeyRevokeApi.as_view(), name="apikey-revoke"),
    path("basemodels", ops.BaseModelsApi.as_view(), name="basemodels"),
    path("basemodels/<str:name>", ops.BaseModelDetailApi.as_view(), name="basemodel"),
    path("deployments", ops.DeploymentsApi.as_view(), name="deployments"),
    path("deployments/<str:name>", ops.DeploymentDetailApi.as_view(), name="deployment"),
    path("hosts", ops.HostsApi.as_view(), name="hosts"),
    path("hosts/<str:name>", ops.HostDetailApi.as_view(), name="host"),
    path("hosts/<str:name>/drain", ops.HostDrainApi.as_view(), name="host-drain"),
    path("hosts/<str:name>/undrain", ops.HostUndrainApi.as_view(), name="host-undrain"),
    path(
        "hosts/<str:name>/engine_groups",
        ops_engine_groups.EngineGroupsApi.as_view(),
        name="host-engine-groups",
    ),
    path(
        "hosts/<str:name>/engine_groups/<int:index>",
        ops_engine_groups.EngineGroupDetailApi.as_view(),
        name="host-engine-group",
    ),
    path(
        "hosts/<str:name>/adapters",
        ops_host_adapters.HostAdaptersApi.as_view(),
        name="host-adapters",
    ),
    path(
        "hosts/<str:name>/adapters/load",
        ops_host_adapters.HostAdapterLoadApi.as_view(),
        name="host-adapters-load",
    ),
    path(
        "hosts/<str:name>/adapters/unload",
        ops_host_adapters.HostAdapterUnloadApi.as_view(),
        name="host-adapters-unload",
    ),
    path("placements", ops.PlacementsApi.as_view(), name="placements"),
    path("jobs", ops.JobsApi.as_view(), name="jobs"),
    path("jobs/<str:job_id>", ops.JobDetailOpsApi.as_view(), name="job"),
    path("jobs/<str:job_id>/events", ops.JobEventsOpsApi.as_view(), name="job-events"),
    path("jobs/<str:job_id>/cancel", ops.JobCancelOpsApi.as_view(), name="job-cancel"),
    path("usage", ops_usage.UsageOpsApi.as_view(), name="usage"),
]
