"""Console-only reads: metric time series, job progress, predictor accuracy, filtered job lists,
a tenant's usage per model.

Reads that the APIs share live in `api.selectors` and `api.usage_selectors`; this package holds
what only the console needs. Metric rows are written by the control plane's metrics ingestion
(models `HostMetric`, `DeploymentMetric`, `JobMetric`); the console only reads them.
"""

from console.selectors.jobs import (
    ETA_WINDOW_REPORTS,
    JobProgress,
    current_hosts,
    estimated_total_steps,
    job_list,
    job_progress_map,
    job_series,
    progress_from,
)
from console.selectors.metrics import (
    DEPLOYMENT_COLUMNS,
    DeploymentSummary,
    attainment_series,
    deployment_series,
    deployment_summaries,
    host_finetune_series,
    host_memory_latest,
    host_series,
    summarize,
)
from console.selectors.predictors import PredictorAccuracy, predictor_accuracy, predictor_pairs
from console.selectors.series import (
    DEFAULT_RANGE,
    FRESHNESS,
    MAX_POINTS,
    MIN_BUCKET,
    RANGES,
    Columns,
    bucket_width,
    columns_from_rows,
    combine_hosts,
    downsample,
    parse_range,
)
from console.selectors.usage import ModelUsage, tenant_usage_by_model

__all__ = [
    "DEFAULT_RANGE",
    "DEPLOYMENT_COLUMNS",
    "ETA_WINDOW_REPORTS",
    "FRESHNESS",
    "MAX_POINTS",
    "MIN_BUCKET",
    "RANGES",
    "Columns",
    "DeploymentSummary",
    "JobProgress",
    "ModelUsage",
    "PredictorAccuracy",
    "attainment_series",
    "bucket_width",
    "columns_from_rows",
    "combine_hosts",
    "current_hosts",
    "deployment_series",
    "deployment_summaries",
    "downsample",
    "estimated_total_steps",
    "host_finetune_series",
    "host_memory_latest",
    "host_series",
    "job_list",
    "job_progress_map",
    "job_series",
    "parse_range",
    "predictor_accuracy",
    "predictor_pairs",
    "progress_from",
    "summarize",
    "tenant_usage_by_model",
]
