"""The gateway's ASGI app under uvicorn against hosts that refuse, break off or vanish: retries,
ejection, error events, the errors it answers itself, rate limits and usage, on the real
database (both backends).

The hosts here are small ASGI apps behind real sockets that answer as a host would (the real
host server's behaviour is tested in tests/gpu_runtime/server and end to end in
tests/e2e/test_gateway.py); what they check is each grant the gateway sends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from django.conf import settings as django_settings
from django.core.asgi import get_asgi_application

from api.gateway.asgi import with_gateway
from api.models import GpuHost, TenantUsage
from api.services.apikeys import api_key_issue_for_tenant
from api.services.fleet import base_model_register, deployment_create, host_register
from api.services.reports.heartbeat import heartbeat_apply
from api.services.tenants import tenant_create, tenant_limits_set
from gpu_runtime.contract.grants import (
    GRANT_HEADER,
    PROMPT_TOKENS_HEADER,
    grant_verify,
    host_key,
)
from gpu_runtime.server.threaded import ThreadedServer

pytestmark = pytest.mark.django_db(transaction=True)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chunk(text: str) -> bytes:
    return sse({"object": "text_completion", "choices": [{"index": 0, "text": text,
                                                          "finish_reason": None}]})  # fmt: skip


@dataclass
class FakeHost:
    """A host's HTTP side: `mode` "ok" (streams or answers in full), "refuse" (503),
    "break" (two events, then the connection drops)."""

    name: str
    mode: str = "ok"
    grants: list[Any] = field(default_factory=list)
    request_ids: list[str | None] = field(default_factory=list)
    """The `x-request-id` header of each request."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = dict((k.decode(), v.decode()) for k, v in scope["headers"])
        key = host_key(django_settings.GATEWAY_SECRET, self.name)
        grant = grant_verify(headers[GRANT_HEADER], key, host=self.name, now=time.time())
        self.grants.append(grant)
        self.request_ids.append(headers.get("x-request-id"))
        request = json.loads(body)
        if self.mode == "refuse":
            await _whole(send, 503, {"error": {"message": "busy", "type": "server_error",
                                               "param": None, "code": "overloaded"}})  # fmt: skip
            return
        if not request.get("stream"):
            await _whole(send, 200, {"object": "text_completion", "model": request["model"],
                                     "choices": [{"index": 0, "text": self.name}],
                                     "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                               "total_tokens": 7}})  # fmt: skip
            return
        stream_headers = [(b"content-type", b"text/event-stream"),
                          (PROMPT_TOKENS_HEADER.encode(), b"5")]  # fmt: skip
        await send({"type": "http.response.start", "status": 200, "headers": stream_headers})
        events = [chunk("a"), chunk("b")]
        if self.mode == "break":
            for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            raise RuntimeError("the host fails mid-stream")  # uvicorn drops the connection
        assert request["stream_options"]["include_usage"] is True  # the gateway always asks
        events += [sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}),
                   b"data: [DONE]\n\n"]  # fmt: skip
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


async def _whole(send: Any, status: int, payload: dict[str, Any]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


@dataclass
class Fleet:
    gateway: str
    hosts: dict[str, FakeHost]
    key: str
    other_key: str
    tenant: Any


@pytest.fixture
def fleet(settings: Any) -> Iterator[Fleet]:
    settings.HARLI_USAGE_FLUSH_INTERVAL_S = 0.5
    tiny = base_model_register(name="tiny", preset="tiny")
    deployment = deployment_create(name="tiny-chat", base_model=tiny, tpot_slo_ms=50,
                                   ttft_slo_ms=500)  # fmt: skip
    tenant = tenant_create(name="acme")
    key = api_key_issue_for_tenant(tenant=tenant).key
    other = api_key_issue_for_tenant(tenant=tenant_create(name="globex")).key
    hosts = {name: FakeHost(name) for name in ("host-a", "host-b")}
    servers = {name: ThreadedServer(app) for name, app in hosts.items()}
    gateway = ThreadedServer(with_gateway(get_asgi_application()))
    for server in (*servers.values(), gateway):
        server.start()
    for index, (name, server) in enumerate(servers.items()):
        host = host_register(name=name, gpu_kind="cpu", gpu_memory_bytes=2**34,
                             deployment=deployment)  # fmt: skip
        heartbeat_apply(host=host, message={
            "base_model": "tiny", "server_url": server.url, "draining": False,
            "total_bytes": 2**34, "free_bytes": 2**33, "placements": [], "adapters": [],
            # host-a is the less loaded: it is tried first
            "serving": {"running": index, "waiting": 0, "kv_free_pages": 10,
                        "kv_total_pages": 10},
        })  # fmt: skip
    try:
        yield Fleet(gateway.url.removesuffix("/v1"), hosts, key, other, tenant)
    finally:
        for server in (gateway, *servers.values()):
            server.stop()


def post(fleet: Fleet, body: dict[str, Any], key: str | None = None, **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key or fleet.key}"}
    return httpx.post(f"{fleet.gateway}/v1/completions", json=body, headers=headers, timeout=20,
                      **kw)  # fmt: skip


BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def test_the_least_loaded_host_answers_with_a_grant_for_the_one_model(fleet: Fleet) -> None:
    answer = post(fleet, BODY)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == "host-a"
    assert answer.headers["x-request-id"].startswith("req_")
    (grant,) = fleet.hosts["host-a"].grants
    assert (grant.host, grant.tenant, grant.models) == ("host-a", "acme", ("tiny",))
    assert grant.request_id == answer.headers["x-request-id"]
    assert time.time() < grant.expires_at <= time.time() + 61


def test_a_clients_request_id_is_answered_and_forwarded_to_the_host(fleet: Fleet) -> None:
    def with_id(request_id: str) -> httpx.Response:
        headers = {"authorization": f"Bearer {fleet.key}", "x-request-id": request_id}
        return httpx.post(f"{fleet.gateway}/v1/completions", json=BODY, headers=headers,
                          timeout=20)  # fmt: skip

    answer = with_id("client-7")
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "client-7"
    assert fleet.hosts["host-a"].request_ids == ["client-7"]
    assert [grant.request_id for grant in fleet.hosts["host-a"].grants] == ["client-7"]
    # one a client may not choose is replaced, on both sides
    refused = with_id("x" * 129)
    assert refused.headers["x-request-id"].startswith("req_")
    assert fleet.hosts["host-a"].request_ids[1] == refused.headers["x-request-id"]


def test_a_refusal_before_the_first_byte_is_retried_on_the_other_host(fleet: Fleet) -> None:
    fleet.hosts["host-a"].mode = "refuse"
    answer = post(fleet, BODY)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "host-b"
    # both refuse: the last refusal reaches the client as the host sent it
    fleet.hosts["host-b"].mode = "refuse"
    refused = post(fleet, BODY)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"


def test_a_host_that_fails_mid_stream_ends_the_stream_with_an_error_event(fleet: Fleet) -> None:
    fleet.hosts["host-a"].mode = "break"
    answer = post(fleet, {**BODY, "stream": True})
    assert answer.status_code == 200
    events = [e for e in answer.text.split("\n\n") if e]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "upstream_error")
    # the failed host is ejected: the next request goes to the other, though it is more loaded
    assert post(fleet, BODY).json()["choices"][0]["text"] == "host-b"


def test_a_stream_passes_through_and_the_usage_chunk_only_when_asked(fleet: Fleet) -> None:
    plain = post(fleet, {**BODY, "stream": True})
    assert plain.headers["content-type"] == "text/event-stream"
    assert plain.text == (chunk("a") + chunk("b") + b"data: [DONE]\n\n").decode()
    asked = post(fleet, {**BODY, "stream": True, "stream_options": {"include_usage": True}})
    assert '"usage": {"prompt_tokens": 5, "completion_tokens": 2}' in asked.text


def until(check: Any, timeout_s: float = 10.0) -> Any:
    """Poll `check` until it returns something truthy (the gateway's fleet view refreshes in
    the background every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return value


def test_a_host_that_cannot_be_reached_is_skipped(fleet: Fleet) -> None:
    state = GpuHost.objects.get(name="host-a").agent_state
    state.server_url = "http://127.0.0.1:9/v1"  # the discard port: connection refused
    state.save()
    answers = []

    def answered_by_b() -> bool:
        answer = post(fleet, BODY)
        answers.append(answer.status_code)
        return answer.json()["choices"][0]["text"] == "host-b"

    until(answered_by_b)
    assert set(answers) == {200}  # never an error: the refused connection was retried


def test_errors_the_gateway_answers_itself(fleet: Fleet) -> None:
    assert post(fleet, BODY, key="hk-wrong").json()["error"]["code"] == "invalid_api_key"
    missing = httpx.post(f"{fleet.gateway}/v1/completions", json=BODY)
    assert missing.status_code == 401
    assert post(fleet, {"prompt": "x"}).json()["error"]["param"] == "model"
    bad = httpx.post(f"{fleet.gateway}/v1/completions", content=b"{", headers={
        "authorization": f"Bearer {fleet.key}"})  # fmt: skip
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_json")
    assert post(fleet, {**BODY, "stream": "yes"}).json()["error"]["param"] == "stream"
    unknown = post(fleet, {**BODY, "model": "ft:tiny:globex::job-x"})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")
    assert httpx.get(f"{fleet.gateway}/v1/completions").status_code == 405
    huge = post(fleet, {**BODY, "prompt": "x" * (django_settings.GATEWAY_MAX_BODY_BYTES + 1)})
    assert (huge.status_code, huge.json()["error"]["code"]) == (413, "request_too_large")
    GpuHost.objects.all().update(status="offline")
    gone = until(lambda: (r := post(fleet, BODY)).status_code == 503 and r)
    assert gone.json()["error"]["code"] == "model_unavailable"


def test_rate_limit_429_with_openais_headers_and_usage_per_minute(fleet: Fleet) -> None:
    tenant_limits_set(tenant=fleet.tenant, requests_per_minute=2, tokens_per_minute=None)
    first, second, third = (post(fleet, BODY) for _ in range(3))
    assert [first.status_code, second.status_code, third.status_code] == [200, 200, 429]
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert [r.headers["x-ratelimit-remaining-requests"] for r in (first, second)] == ["1", "0"]
    error = third.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert int(third.headers["retry-after"]) >= 1
    assert "x-ratelimit-limit-tokens" not in third.headers  # no token limit set
    # the other tenant has no limit; usage is counted per tenant and flushed in batches
    assert post(fleet, BODY, key=fleet.other_key).status_code == 200

    def usage() -> list[tuple[str, int, int, int]]:
        rows = TenantUsage.objects.order_by("tenant__name")
        return [(r.tenant.name, r.requests, r.prompt_tokens, r.completion_tokens) for r in rows]

    until(lambda: usage() == [("acme", 2, 10, 4), ("globex", 1, 5, 2)])
    assert TenantUsage.objects.count() == 2  # one row per tenant, model and minute
