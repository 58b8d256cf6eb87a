"""One cluster per e2e module: private Redis (append-only), the test database (PostgreSQL, or
the SQLite file with HARLI_TEST_DB=sqlite), the web process under uvicorn (API, console,
gateway; rate limits in the private Redis), a Celery worker and beat, and two host
agents: `agent-a` with a latency predictor artifact for the tiny model, `agent-b` without.

Short intervals for the tests come from the environment: heartbeats every 0.5 s, a host is lost
after 4 s of silence, reconciliation every second, checkpoints every 10 optimizer steps, key
cache TTL 2 s.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, free_port, wait_until
from tests.gpu_runtime.agent.artifacts import write_tiny_artifact

AGENTS = ("agent-a", "agent-b")

TRAIN_PAIRS = [
    ("Q: colour of the sky?", " A: blue"),
    ("Q: hello", " A: world"),
    ("Q: numbers", " A: 1 2 3 4 5"),
    ("Q: adapters", " A: low-rank"),
    ("Q: the sea", " A: a short poem about the sea"),
    ("Q: decode", " A: reads every weight once per step"),
    ("Q: batching", " A: continuous, at every step"),
    ("Q: once upon", " A: a time there was a small model"),
]


@dataclass
class Tenants:
    key: str
    other_key: str
    key_prefix: str


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_runtime.model.tiny import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture
def seeded(cluster: Cluster, transactional_db: None) -> Iterator[Tenants]:
    """Fleet and tenants in the test database (flushed after every test), both hosts online.

    The cluster's processes outlive a test: after the flush their heartbeats name unknown hosts
    (ignored) until the next test registers the hosts again.
    """
    from api.models import GpuHost
    from api.services.apikeys import api_key_issue_for_tenant
    from api.services.fleet import base_model_register, deployment_create, host_register
    from api.services.tenants import tenant_create

    tiny = base_model_register(name="tiny", preset="tiny")
    deployment = deployment_create(name="tiny-chat", base_model=tiny, tpot_slo_ms=1000,
                                   ttft_slo_ms=5000)  # fmt: skip
    for host in AGENTS:
        host_register(name=host, gpu_kind="cpu", gpu_memory_bytes=16 * 2**30,
                      deployment=deployment)  # fmt: skip
    issued = api_key_issue_for_tenant(tenant=tenant_create(name="acme"))
    other = api_key_issue_for_tenant(tenant=tenant_create(name="globex"))
    alive = [h for h in AGENTS if cluster.procs[h].alive()]
    # One worker process (solo pool) applies every report in order: on a loaded machine it may
    # first work through what the previous test left (a stopped agent's backlog, a pass of
    # reconciliation), so the first heartbeat of the re-registered hosts can take a while.
    wait_until(
        lambda: GpuHost.objects.filter(name__in=alive, status="online").count() == len(alive),
        90,
        "the agents' heartbeats",
    )
    yield Tenants(issued.key, other.key, issued.api_key.prefix)
    # Unregister the hosts first: the agents keep heartbeating, and reports of unknown hosts
    # write nothing, so the flush that follows does not contend with the worker's writes.
    from django.db import DatabaseError

    from api.models import FinetuneJob, Placement

    for _ in range(20):  # a heartbeat or metric may race the delete (FK or deadlock): retry
        try:
            Placement.objects.all().delete()
            GpuHost.objects.all().delete()
            break
        except DatabaseError:
            time.sleep(0.2)
    FinetuneJob.objects.all().delete()
    time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster_env() -> dict[str, str]:
    """What a test module adds to (or changes in) its cluster's environment; a module that
    needs other intervals overrides this fixture."""
    return {}


@pytest.fixture(scope="module")
def hosts_take_tenant_keys() -> bool:
    """Whether the cluster's agents also accept tenants' API keys on requests without a grant
    (`--allow-tenant-keys`): the modules that call hosts directly need it; a module whose
    hosts take only the gateway's grants overrides this fixture with False."""
    return True


@pytest.fixture(scope="module")
def cluster(
    django_db_setup: None,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    cluster_env: dict[str, str],
    hosts_take_tenant_keys: bool,
) -> Iterator[Cluster]:
    from django.db import connection

    from config.database import database_url

    tmp = tmp_path_factory.mktemp("cluster")
    db = connection.settings_dict
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": database_url(db),
        "HARLI_STORAGE_DIR": str(tmp / "storage"),
        "HARLI_HOST_LOST_AFTER_S": "4",
        "HARLI_RECONCILE_INTERVAL_S": "1",
        "HARLI_REDISPATCH_AFTER_S": "8",
        "HARLI_CHECKPOINT_EVERY_STEPS": "10",
        "HARLI_KEEP_CHECKPOINTS": "1",
        "HARLI_BROKER_VISIBILITY_TIMEOUT_S": "5",
        "PYTHONUNBUFFERED": "1",
        "HARLI_LOG_LEVEL": "WARNING",
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
        # agent-a has a latency predictor (heartbeats carry its version and estimate)
        predictors = write_tiny_artifact(tiny_model_dir, tmp / "predictors")
        cluster.start_agent("agent-a", ("--predictor", str(predictors)))
        cluster.start_agent("agent-b")
        cluster.wait_ready("web", "worker", "beat", *AGENTS)
        yield cluster
    finally:
        cluster.stop()


def training_jsonl() -> bytes:
    import json

    return "".join(
        json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in TRAIN_PAIRS
    ).encode()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed e2e test's report (its set-up included) carries the tail of each cluster
    process's log (the worker's and the agents' side of what the test waited for)."""
    report = yield
    if report.when in ("setup", "call") and report.failed:
        cluster = getattr(item, "funcargs", {}).get("cluster")
        if isinstance(cluster, Cluster):
            report.sections.append(("cluster logs", cluster.logs(lines=40)))
    return report
