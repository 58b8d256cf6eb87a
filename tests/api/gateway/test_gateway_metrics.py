"""The gateway's metrics, scraped from `/metrics` of the same ASGI app (uvicorn, real hosts'
sockets, the real database) after real inference requests: counts per tenant, model and
outcome, tokens, and request latency by route and status class."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.gateway.test_gateway_app import BODY, Fleet, fleet, post  # noqa: F401
from tests.scrape import Samples, moved, parse

pytestmark = pytest.mark.django_db(transaction=True)
TOKEN = "scrape-token-gateway"


def scrape(fleet: Fleet) -> Samples:  # noqa: F811
    response = httpx.get(f"{fleet.gateway}/metrics", headers={"authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.text
    return parse(response.text)


def test_inference_requests_counted_per_tenant_model_and_outcome(
    fleet: Fleet,  # noqa: F811
    settings: Any,
) -> None:
    settings.METRICS_TOKEN = TOKEN
    before = scrape(fleet)
    for _ in range(2):
        assert post(fleet, BODY).status_code == 200
    assert post(fleet, {**BODY, "stream": True}).status_code == 200
    fleet.hosts["host-a"].mode = "break"
    assert post(fleet, {**BODY, "stream": True}).status_code == 200  # then an error event
    assert post(fleet, BODY, key="hk-wrong").status_code == 401
    assert post(fleet, {**BODY, "model": "ft:tiny:globex::job-x"}).status_code == 404
    after = scrape(fleet)

    requests = "harli_gateway_inference_requests_total"
    acme = {"tenant": "acme", "model": "tiny"}
    assert moved(before, after, requests, **acme, outcome="ok") == 3
    assert moved(before, after, requests, **acme, outcome="upstream_error") == 1
    assert moved(before, after, requests, tenant="", model="", outcome="unauthenticated") == 1
    assert moved(before, after, requests, tenant="acme", model="", outcome="model_not_found") == 1
    tokens = "harli_gateway_inference_tokens_total"
    assert moved(before, after, tokens, **acme, kind="prompt") == 5 * 4  # the broken one too
    # 2 each from the whole answers and the stream's usage; the broken stream's relayed chunks
    assert moved(before, after, tokens, **acme, kind="completion") >= 2 * 3
    latency = "harli_http_request_duration_seconds_count"
    route = {"route": "/v1/completions", "method": "POST"}
    assert moved(before, after, latency, **route, status_class="2xx") == 4
    assert moved(before, after, latency, **route, status_class="4xx") == 2
