"""`/tokenize` and `/detokenize` through the gateway, so tenants keep one base URL: routed to a
real host server (the tiny model, accepting only the gateway's grants) at the host's root, as
vLLM serves them; they count as requests but record no token usage (both backends)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings as django_settings
from django.core.asgi import get_asgi_application

from api.gateway.asgi import with_gateway
from api.models import TenantUsage
from api.services.apikeys import api_key_issue_for_tenant
from api.services.fleet import base_model_register, deployment_create, host_register
from api.services.reports.heartbeat import heartbeat_apply
from api.services.tenants import tenant_create, tenant_limits_set
from gpu_runtime.contract.grants import host_key
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.model.loader import load_model, load_tokenizer
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import EngineLoop, GatewayGrants, create_app
from gpu_runtime.server.threaded import ThreadedServer

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass
class Served:
    gateway: str
    key: str
    tenant: Any
    tokenizer: Any


@pytest.fixture
def served(settings: Any, tmp_path: Path) -> Iterator[Served]:
    settings.HARLI_USAGE_FLUSH_INTERVAL_S = 0.2
    model_dir = build_tiny_model_dir(tmp_path / "model", "llama", seed=1)
    tokenizer = load_tokenizer(model_dir)
    config = EngineConfig(num_kv_blocks=32, block_size=8, max_num_seqs=2,
                          max_num_batched_tokens=64, max_model_len=64)  # fmt: skip
    loop = EngineLoop(Engine(load_model(model_dir), config, tokenizer=tokenizer))
    loop.start()
    auth = GatewayGrants(host="h1", key=host_key(django_settings.GATEWAY_SECRET, "h1"))
    host_server = ThreadedServer(create_app(loop, "tiny", auth))
    gateway = ThreadedServer(with_gateway(get_asgi_application()))
    host_server.start()
    gateway.start()
    tiny = base_model_register(name="tiny", preset="tiny")
    deployment = deployment_create(name="tiny-chat", base_model=tiny, tpot_slo_ms=50,
                                   ttft_slo_ms=500)  # fmt: skip
    host = host_register(name="h1", gpu_kind="cpu", gpu_memory_bytes=2**34, deployment=deployment)
    heartbeat_apply(host=host, message={
        "base_model": "tiny", "server_url": host_server.url, "draining": False,
        "total_bytes": 2**34, "free_bytes": 2**33, "placements": [], "adapters": [],
        "serving": {"running": 0, "waiting": 0, "kv_free_pages": 10, "kv_total_pages": 10},
    })  # fmt: skip
    tenant = tenant_create(name="acme")
    try:
        yield Served(gateway.url.removesuffix("/v1"), api_key_issue_for_tenant(tenant=tenant).key,
                     tenant, tokenizer)  # fmt: skip
    finally:
        gateway.stop()
        host_server.stop()
        loop.stop()


def _post(served: Served, path: str, body: dict[str, Any], key: str | None = None) -> Any:
    headers = {"authorization": f"Bearer {key or served.key}"}
    return httpx.post(served.gateway + path, json=body, headers=headers, timeout=30)


def test_tokenize_and_detokenize_through_the_gateway(served: Served) -> None:
    text = "hello there, tokenizer"
    ids = list(served.tokenizer(text)["input_ids"])
    out = _post(served, "/tokenize", {"model": "tiny", "prompt": text})
    assert out.status_code == 200, out.text
    assert out.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids}
    assert out.headers["x-request-id"].startswith("req_")
    back = _post(served, "/detokenize", {"model": "tiny", "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": served.tokenizer.decode(ids)}
    # the host's own refusals pass through; the gateway's come first
    assert _post(served, "/detokenize", {"model": "tiny", "tokens": [-1]}).status_code == 400
    assert _post(served, "/tokenize", {"prompt": text}).json()["error"]["param"] == "model"
    missing = _post(served, "/tokenize", {"model": "ft:tiny:acme:x:ftjob-1", "prompt": text})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    refused = _post(served, "/tokenize", {"model": "tiny", "prompt": text}, key="sk-x")
    assert refused.status_code == 401
    assert httpx.get(served.gateway + "/tokenize", timeout=10).status_code == 405


def test_they_count_as_requests_and_record_no_usage(served: Served) -> None:
    tenant_limits_set(tenant=served.tenant, requests_per_minute=4, tokens_per_minute=None)
    completion = _post(served, "/v1/completions", {"model": "tiny", "prompt": "hi",
                                                   "max_tokens": 2})  # fmt: skip
    assert completion.status_code == 200, completion.text
    statuses = [_post(served, "/tokenize", {"model": "tiny", "prompt": "hi"}).status_code
                for _ in range(3)]  # fmt: skip
    statuses.append(_post(served, "/detokenize", {"model": "tiny", "tokens": [1]}).status_code)
    assert statuses == [200, 200, 200, 429]
    deadline = time.monotonic() + 10
    while not TenantUsage.objects.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # five more flushes: any usage of the later requests would be written
    rows = [(r.model, r.requests, r.completion_tokens) for r in TenantUsage.objects.all()]
    assert rows == [("tiny", 1, 2)]  # the completion only
