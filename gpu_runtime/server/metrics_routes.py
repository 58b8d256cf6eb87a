"""``GET /metrics``: the server's `ServerMetrics` in Prometheus' text format.

Guarded by the bearer token `metrics_token` of `create_app` (a host agent's
`HARLI_METRICS_TOKEN`): a scrape without it, or with another, is a 401; without a token
configured the route is off (404), since the labels name tenants and adapters."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gpu_runtime.contract.metrics_scrape import bearer_matches
from gpu_runtime.server.prometheus import ServerMetrics
from gpu_runtime.server.protocol import OpenAIError

METRICS_TOKEN_ENV = "HARLI_METRICS_TOKEN"
router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    token: str | None = request.app.state.metrics_token
    if not token:
        raise OpenAIError(404, "Not found.", code="not_found")
    if not bearer_matches(request.headers.get("authorization"), token):
        raise OpenAIError(401, "Incorrect or missing metrics token.", code="invalid_api_key")
    prometheus: ServerMetrics = request.app.state.prometheus
    return Response(prometheus.exposition(), media_type=CONTENT_TYPE_LATEST)
