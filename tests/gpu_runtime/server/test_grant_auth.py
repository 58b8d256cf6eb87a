"""A host's server behind the gateway, under uvicorn: a request is accepted only with a grant
signed with the host's key for this host and not expired, and may call exactly the grant's
models; every refusal is a 401 in OpenAI's shape with its reason logged (never the token).
Every completion answers with its prompt tokens in a header."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_runtime.contract.grants import (
    GRANT_HEADER,
    PROMPT_TOKENS_HEADER,
    Grant,
    grant_sign,
    host_key,
)
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import (
    BearerKeys,
    EngineLoop,
    GatewayGrants,
    create_app,
    static_key_checker,
)
from tests.gpu_runtime.server.serving import serve_in_thread

HOST = "gpu-07"
KEY = host_key("fleet-secret", HOST)
MODEL = "tiny-llama"
TENANT_KEY = "sk-tenant"
Served = tuple[str, str, str]
"""`/v1` URLs: grants only; grants and tenant keys; a host without a key."""


def grant(
    models: tuple[str, ...] = (MODEL,),
    *,
    host: str = HOST,
    expires_in_s: float = 60.0,
    key: str = KEY,
    request_id: str = "req-1",
) -> dict[str, str]:
    signed = grant_sign(Grant(host, "acme", models, time.time() + expires_in_s, request_id), key)
    return {GRANT_HEADER: signed}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir: Path = build_tiny_model_dir(tmp_path_factory.mktemp("grants"), "llama", seed=3)
    config = EngineConfig(
        num_kv_blocks=128, block_size=8, max_num_seqs=8, max_num_batched_tokens=256,
        max_model_len=256,
    )  # fmt: skip
    loop = EngineLoop(Engine.from_directory(model_dir, config))
    loop.start()
    tenant_keys = BearerKeys(static_key_checker([TENANT_KEY]))
    apps = [
        create_app(loop, MODEL, GatewayGrants(host=HOST, key=KEY)),
        create_app(loop, MODEL, GatewayGrants(host=HOST, key=KEY, tenant_keys=tenant_keys)),
        create_app(loop, MODEL, GatewayGrants(host=HOST, key=None)),
    ]
    try:
        with (
            serve_in_thread(apps[0]) as grants_only,
            serve_in_thread(apps[1]) as with_keys,
            serve_in_thread(apps[2]) as keyless,
        ):
            yield grants_only, with_keys, keyless
    finally:
        loop.stop()


def _complete(base: str, headers: dict[str, str], **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0.0} | body
    return httpx.post(f"{base}/completions", json=payload, headers=headers, timeout=60)


def test_a_grant_allows_exactly_its_models(served: Served) -> None:
    base = served[0]
    done = _complete(base, grant())
    assert done.status_code == 200 and done.json()["model"] == MODEL
    listed = httpx.get(f"{base}/models", headers=grant(), timeout=10).json()
    assert [m["id"] for m in listed["data"]] == [MODEL]
    other = grant(("ft:tiny-llama:globex::ftjob-1",))
    assert httpx.get(f"{base}/models", headers=other, timeout=10).json()["data"] == []
    missing = _complete(base, other)  # the base model is outside this grant: nonexistent
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    health = httpx.get(base.removesuffix("/v1") + "/health", timeout=10)  # no grant needed
    assert health.status_code == 200 and health.json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        (grant(expires_in_s=-10.0), "the grant has expired"),
        (grant(host="gpu-08"), "the grant is for host 'gpu-08', not 'gpu-07'"),
        (grant(key=host_key("fleet-secret", "gpu-08")), "bad grant signature"),
        (grant(key=host_key("another-secret", HOST)), "bad grant signature"),
        ({GRANT_HEADER: "v1.e30.c2ln"}, "bad grant signature"),
        ({GRANT_HEADER: "v2.a.b"}, "malformed grant"),
        ({}, f"no {GRANT_HEADER} header"),
        ({"authorization": f"Bearer {TENANT_KEY}"}, f"no {GRANT_HEADER} header"),
    ],
    ids=["expired", "wrong-host", "other-host-key", "other-secret", "forged", "malformed",
         "missing", "bearer-key"],
)  # fmt: skip
def test_refused_grants_are_401_with_the_reason_logged(
    served: Served, headers: dict[str, str], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gpu_runtime.server.inference"):
        refused = _complete(served[0], headers)
        models = httpx.get(f"{served[0]}/models", headers=headers, timeout=10)
    assert refused.status_code == 401 and models.status_code == 401
    assert refused.json() == {
        "error": {
            "message": "Incorrect or missing API key.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"refused POST /v1/completions: {reason}",
        f"refused GET /v1/models: {reason}",
    ]
    secret = headers.get(GRANT_HEADER, "").rsplit(".", 1)[-1]
    secret = secret or headers.get("authorization", "").removeprefix("Bearer ")
    assert not secret or not any(secret in message for message in warnings)


def test_tenant_keys_only_where_allowed_and_never_instead_of_a_bad_grant(
    served: Served,
) -> None:
    _, with_keys, keyless = served
    bearer = {"authorization": f"Bearer {TENANT_KEY}"}
    assert _complete(with_keys, bearer).status_code == 200
    assert _complete(with_keys, {"authorization": "Bearer sk-wrong"}).status_code == 401
    assert _complete(with_keys, grant()).status_code == 200
    expired = grant(expires_in_s=-10.0) | bearer  # a grant is checked when present
    assert _complete(with_keys, expired).status_code == 401
    assert _complete(keyless, grant()).status_code == 401  # no key: no grant verifies
    assert _complete(keyless, bearer).status_code == 401


def test_each_request_logs_its_grant_at_debug(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="gpu_runtime.server.inference"):
        assert _complete(served[0], grant(request_id="gw-42")).status_code == 200
    assert "POST /v1/completions: request gw-42 of tenant acme" in caplog.messages


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_every_completion_carries_its_prompt_tokens(served: Served, stream: bool) -> None:
    base = served[0]
    usage_options: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("completions", {"prompt": "Hello there"}),
        ("completions", {"prompt": ["Hello there", "Once upon a time"]}),
        ("chat/completions", {"messages": [{"role": "user", "content": "Say hi"}]}),
    ]
    for route, body in bodies:
        payload: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "stream": stream}
        payload |= body | usage_options
        response = httpx.post(f"{base}/{route}", json=payload, headers=grant(), timeout=60)
        assert response.status_code == 200
        usage = _events(response)[-1]["usage"] if stream else response.json()["usage"]
        assert int(response.headers[PROMPT_TOKENS_HEADER]) == usage["prompt_tokens"] > 0
    single, many = (
        httpx.post(
            f"{base}/completions",
            headers=grant(),
            timeout=60,
            json={"model": MODEL, "max_tokens": 1, "prompt": p},
        )  # fmt: skip
        for p in ("Hello there", ["Hello there", "Hello there"])
    )
    assert int(many.headers[PROMPT_TOKENS_HEADER]) == 2 * int(single.headers[PROMPT_TOKENS_HEADER])
    refused = _complete(base, grant(("other",)))  # no header on an error
    assert refused.status_code == 404 and PROMPT_TOKENS_HEADER not in refused.headers
