"""Routes of the operator console (namespace `console`), mounted at /console/."""

from __future__ import annotations

from django.urls import URLPattern, path

from console.views import auth, charts, fleet, jobs, tenants

app_name = "console"

urlpatterns: list[URLPattern] = [
    path("login/", auth.ConsoleLoginView.as_view(), name="login"),
    path("logout/", auth.ConsoleLogoutView.as_view(), name="logout"),
    path("", fleet.FleetView.as_view(), name="fleet"),
    path("deployments/<str:name>/", fleet.DeploymentView.as_view(), name="deployment"),
    path("hosts/", fleet.HostsView.as_view(), name="hosts"),
    path("hosts/<str:name>/", fleet.HostView.as_view(), name="host"),
    path("hosts/<str:name>/drain/", fleet.HostDrainView.as_view(), name="host-drain"),
    path("hosts/<str:name>/undrain/", fleet.HostUndrainView.as_view(), name="host-undrain"),
    path("models/", fleet.BaseModelsView.as_view(), name="models"),
    path("predictors/", fleet.PredictorsView.as_view(), name="predictors"),
    path("jobs/", jobs.JobListView.as_view(), name="jobs"),
    path("jobs/<str:job_id>/", jobs.JobDetailView.as_view(), name="job"),
    path("jobs/<str:job_id>/<str:action>/", jobs.JobActionView.as_view(), name="job-action"),
    path("tenants/", tenants.TenantsView.as_view(), name="tenants"),
    path("tenants/<str:name>/", tenants.TenantView.as_view(), name="tenant"),
    path("tenants/<str:name>/limits/", tenants.TenantLimitsView.as_view(), name="tenant-limits"),
    path("tenants/<str:name>/keys/", tenants.ApiKeyIssueView.as_view(), name="key-issue"),
    path("keys/<int:key_id>/revoke/", tenants.ApiKeyRevokeView.as_view(), name="key-revoke"),
    path("live/fleet", fleet.FleetLiveView.as_view(), name="live-fleet"),
    path("live/jobs", jobs.JobListLiveView.as_view(), name="live-jobs"),
    path("live/jobs/<str:job_id>", jobs.JobLiveView.as_view(), name="live-job"),
    path(
        "live/deployments/<str:name>",
        fleet.DeploymentLiveView.as_view(),
        name="live-deployment",
    ),
    path("charts/fleet/<str:chart>", charts.FleetChartView.as_view(), name="chart-fleet"),
    path(
        "charts/deployments/<str:name>/<str:chart>",
        charts.DeploymentChartView.as_view(),
        name="chart-deployment",
    ),
    path("charts/hosts/<str:name>/<str:chart>", charts.HostChartView.as_view(), name="chart-host"),
    path("charts/jobs/<str:job_id>/<str:chart>", charts.JobChartView.as_view(), name="chart-job"),
    path(
        "charts/tenants/<str:name>/<str:chart>",
        charts.TenantChartView.as_view(),
        name="chart-tenant",
    ),
    path(
        "charts/predictors/<str:chart>",
        charts.PredictorChartView.as_view(),
        name="chart-predictor",
    ),
]
