"""The agent's server authenticates as `host_auth` builds it from the agent's settings: by the
gateway's grant, verified with the host's key (base model, adapters, and checkpoints granted by
name, loaded without asking the control plane); tenants' API keys only with
`allow_tenant_keys`; nothing at all on a host with neither."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpu_runtime.agent.serving import lora_runtime
from gpu_runtime.contract.protocol import checkpoint_key, checkpoint_model_name
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.engine import SamplingParams
from tests.gpu_runtime.agent.conftest import Host, Reports, make_runtime
from tests.gpu_runtime.agent.host_server import agent_config, agent_server, grant, random_adapter

ADAPTER = "ft:tiny:acme::ftjob-2"
CHECKPOINT = checkpoint_model_name("ft:tiny:acme:x:ftjob-7", 4)


@pytest.fixture()
def idle_host(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports
) -> Iterator[Host]:
    host = make_runtime(tiny_model_dir, storage, tmp_path / "work", reports)
    lora = lora_runtime(host.runtime.engine)
    adapter = random_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    host.runtime.adapters.load_local(lora, ADAPTER, adapter)
    checkpoint = random_adapter(tiny_model_dir, tmp_path / "checkpoint", seed=2)
    storage.put_tree(checkpoint_key("ftjob-7", 4), checkpoint)
    host.loop.start()
    yield host
    host.stop()


def _complete(url: str, model: str, headers: dict[str, str]) -> httpx.Response:
    body = {"model": model, "prompt": "Q: hello", "max_tokens": 4, "temperature": 0.0}
    return httpx.post(f"{url}/completions", json=body, headers=headers, timeout=60)


def test_grants_reach_the_base_model_adapters_and_checkpoints_they_name(
    idle_host: Host, tmp_path: Path
) -> None:
    lora = lora_runtime(idle_host.runtime.engine)
    with agent_server(idle_host, agent_config(tmp_path)) as url:
        base = _complete(url, "tiny", grant("tiny"))
        tuned = _complete(url, ADAPTER, grant(ADAPTER))
        assert base.status_code == tuned.status_code == 200
        assert base.json()["choices"][0]["text"] != tuned.json()["choices"][0]["text"]
        models = httpx.get(f"{url}/models", headers=grant("tiny", ADAPTER), timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny", ADAPTER]
        outside = _complete(url, ADAPTER, grant("tiny"))
        assert outside.status_code == 404
        assert outside.json()["error"]["code"] == "model_not_found"
        assert _complete(url, CHECKPOINT, grant("tiny", ADAPTER)).status_code == 404
        assert not lora.has(CHECKPOINT)  # not granted: not even fetched
        served = _complete(url, CHECKPOINT, grant(CHECKPOINT))  # no control plane to ask
        assert served.status_code == 200 and served.json()["model"] == CHECKPOINT
        assert lora.has(CHECKPOINT)
        assert _complete(url, CHECKPOINT, grant("tiny")).status_code == 404  # loaded, not granted
        missing = checkpoint_model_name("ft:tiny:acme:x:ftjob-7", 8)  # granted, stored nowhere
        assert _complete(url, missing, grant(missing)).status_code == 404
        bearer = {"authorization": "Bearer sk-anything"}
        assert _complete(url, "tiny", bearer).status_code == 401


def test_a_host_with_neither_a_key_nor_tenant_keys_refuses_everything(
    idle_host: Host, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="gpu_runtime.agent.host_auth"):
        config = agent_config(tmp_path, host_key=None)
        with agent_server(idle_host, config) as url:
            assert _complete(url, "tiny", grant("tiny")).status_code == 401
            assert _complete(url, "tiny", {"authorization": "Bearer k"}).status_code == 401
            health = httpx.get(url.removesuffix("/v1") + "/health", timeout=10)
            assert health.status_code == 200
    assert caplog.messages == [
        "host h1 has no host key (--host-key-file or HARLI_HOST_KEY) and takes no tenant keys "
        "(--allow-tenant-keys): every inference request will be refused (401)"
    ]


@pytest.mark.django_db(transaction=True)
def test_tenant_keys_are_checked_only_with_allow_tenant_keys(
    idle_host: Host, tmp_path: Path, live_server: object
) -> None:
    from api.services.apikeys import api_key_issue_for_tenant
    from api.services.fleet import base_model_register
    from api.services.tenants import tenant_create

    base_model_register(name="tiny", preset="tiny")
    key = api_key_issue_for_tenant(tenant=tenant_create(name="acme")).key
    bearer = {"authorization": f"Bearer {key}"}
    control = str(live_server)
    with agent_server(idle_host, agent_config(tmp_path, control_url=control)) as url:
        assert _complete(url, "tiny", bearer).status_code == 401  # off by default
    allowed = agent_config(tmp_path, control_url=control, allow_tenant_keys=True)
    with agent_server(idle_host, allowed) as url:
        assert _complete(url, "tiny", bearer).status_code == 200
        listed = httpx.get(f"{url}/models", headers=bearer, timeout=10).json()
        assert [m["id"] for m in listed["data"]] == ["tiny"]  # the key's models only
        assert _complete(url, ADAPTER, bearer).status_code == 404  # not among its models
        assert _complete(url, "tiny", {"authorization": "Bearer hk-wrong"}).status_code == 401
        assert _complete(url, ADAPTER, grant(ADAPTER)).status_code == 200  # grants still work


def test_the_host_holds_requests_to_its_limits_and_queues_them_under_their_tenant(
    idle_host: Host, tmp_path: Path
) -> None:
    config = agent_config(tmp_path, max_prompts_per_request=2, max_request_prompt_tokens=12)
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0.0}
    with agent_server(idle_host, config) as url:
        for prompt, limit in ((["a", "b", "c"], "at most 2 prompts"), ([[5] * 13], "at most 12")):
            refused = httpx.post(
                f"{url}/completions", json=body | {"prompt": prompt}, headers=grant("tiny")
            )
            assert refused.status_code == 400 and limit in refused.json()["error"]["message"]
        fits = httpx.post(f"{url}/completions", json=body | {"prompt": ["a", "b"]},
                          headers=grant("tiny"), timeout=60)  # fmt: skip
        assert fits.status_code == 200
    runtime = idle_host.runtime
    params = SamplingParams(max_tokens=4)

    def queue_one() -> str:
        runtime.add_request([5, 6, 7], params, "direct-1", None, "acme")
        tenant = runtime.engine.scheduler.get_request("direct-1").tenant
        runtime.abort_request("direct-1")
        return str(tenant)

    assert idle_host.loop.run_in_loop(queue_one).result(30) == "acme"
