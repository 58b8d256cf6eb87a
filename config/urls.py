"""Root URL configuration: tenant API, operator API, OpenAPI schema and docs, operator login,
liveness and readiness probes, Prometheus metrics."""

from django.urls import URLPattern, URLResolver, include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from api.health import healthz, readyz
from api.metrics import metrics
from api.urls import ops_urlpatterns, v1_urlpatterns

urlpatterns: list[URLPattern | URLResolver] = [
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("metrics", metrics, name="metrics"),
    path("v1/", include((v1_urlpatterns, "v1"))),
    path("api/ops/", include((ops_urlpatterns, "ops"))),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    # One password door, the console's throttled login: DRF's login route sends there.
    path(
        "api/auth/login/",
        RedirectView.as_view(pattern_name="console:login", permanent=False, query_string=True),
    ),
    path("api/auth/", include("rest_framework.urls")),
    path("console/", include("console.urls")),
    path("", RedirectView.as_view(pattern_name="console:fleet", permanent=False), name="home"),
]

handler404 = "api.errors.not_found_view"
handler500 = "api.errors.server_error_view"
