"""The gateway relays a host's refusal of a request field unchanged, and its own 400s name the
same `param` the host's do: one real host (`gpu_runtime.server` over a tiny engine, taking only
the gateway's grants) behind the gateway."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings as django_settings
from django.core.asgi import get_asgi_application

from api.gateway.asgi import with_gateway
from api.services.apikeys import api_key_issue_for_tenant
from api.services.fleet import base_model_register, deployment_create, host_register
from api.services.reports.heartbeat import heartbeat_apply
from api.services.tenants import tenant_create
from gpu_runtime.contract.grants import GRANT_HEADER, Grant, grant_sign, host_key
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import EngineLoop, create_app
from gpu_runtime.server.grant_auth import GatewayGrants
from gpu_runtime.server.threaded import ThreadedServer

pytestmark = pytest.mark.django_db(transaction=True)

HOST = "host-a"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
Urls = tuple[str, str, str]
"""The gateway's root URL, the host's `/v1` URL, a tenant's key."""


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Urls]:
    engine = Engine.from_directory(
        build_tiny_model_dir(tmp_path / "tiny", "llama", seed=3),
        EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=2, max_model_len=128),
    )
    loop = EngineLoop(engine)
    loop.start()
    key = host_key(django_settings.GATEWAY_SECRET, HOST)
    host = ThreadedServer(create_app(loop, "tiny", GatewayGrants(host=HOST, key=key)))
    gateway = ThreadedServer(with_gateway(get_asgi_application()))
    host.start()
    gateway.start()
    tiny = base_model_register(name="tiny", preset="tiny")
    deployment = deployment_create(
        name="tiny-chat", base_model=tiny, tpot_slo_ms=50, ttft_slo_ms=500
    )
    registered = host_register(
        name=HOST, gpu_kind="cpu", gpu_memory_bytes=2**34, deployment=deployment
    )
    heartbeat_apply(
        host=registered,
        message={
            "base_model": "tiny",
            "server_url": host.url,
            "draining": False,
            "total_bytes": 2**34,
            "free_bytes": 2**33,
            "placements": [],
            "adapters": [],
            "serving": {"running": 0, "waiting": 0, "kv_free_pages": 10, "kv_total_pages": 10},
        },
    )
    tenant_key = api_key_issue_for_tenant(tenant=tenant_create(name="acme")).key
    try:
        yield gateway.url.removesuffix("/v1"), host.url, tenant_key
    finally:
        gateway.stop()
        host.stop()
        loop.stop()


def _through_gateway(urls: Urls, body: dict[str, Any], path: str = "completions") -> Any:
    gateway, _, key = urls
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{gateway}/v1/{path}", json=body, headers=headers, timeout=30)


def _to_host(urls: Urls, body: dict[str, Any], path: str = "completions") -> Any:
    """The same request straight to the host, with a grant as the gateway signs it."""
    key = host_key(django_settings.GATEWAY_SECRET, HOST)
    grant = grant_sign(Grant(HOST, "acme", ("tiny",), time.time() + 60), key)
    return httpx.post(f"{urls[1]}/{path}", json=body, headers={GRANT_HEADER: grant}, timeout=30)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {**BODY, "no_such_field": 1}, "no_such_field"),
        ("completions", {**BODY, "suffix": "x"}, "suffix"),
        ("completions", {**BODY, "stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
        (
            "chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi", "no_such": 1}]},
            "messages.0.no_such",
        ),
    ],
)
def test_a_hosts_refusal_reaches_the_client_unchanged(
    fleet: Urls, path: str, body: dict[str, Any], param: str
) -> None:
    relayed, direct = _through_gateway(fleet, body, path), _to_host(fleet, body, path)
    assert (relayed.status_code, direct.status_code) == (400, 400)
    assert relayed.json() == direct.json()
    error = relayed.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert param.rsplit(".", 1)[-1] in error["message"]
    assert _through_gateway(fleet, BODY).status_code == 200  # the host serves a valid one


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({**BODY, "stream": "yes"}, "stream"),
        ({**BODY, "stream_options": "all"}, "stream_options"),
        ({**BODY, "max_tokens": "many"}, "max_tokens"),
    ],
)
def test_the_gateways_own_400s_name_the_param_the_host_names(
    fleet: Urls, body: dict[str, Any], param: str
) -> None:
    """The gateway refuses these before routing; the host, asked directly, names the same
    field."""
    ours, hosts = _through_gateway(fleet, body), _to_host(fleet, body)
    assert (ours.status_code, hosts.status_code) == (400, 400)
    assert ours.json()["error"]["param"] == hosts.json()["error"]["param"] == param
    assert ours.json()["error"]["type"] == hosts.json()["error"]["type"]
