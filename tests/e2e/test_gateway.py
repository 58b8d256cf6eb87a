"""One base URL for tenants: fine-tuning and inference through the control plane's gateway, with
two real hosts behind it (routing, failover, disconnects, rate limits, usage).

The hosts accept only the gateway's grants (`HARLI_HOST_KEY`); the web process logs every
routing decision (`harli.gateway` at INFO), which the routing checks read.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.cluster import Cluster, free_port, wait_until
from tests.e2e.conftest import Tenants, training_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROUTE = re.compile(r"route (req_\w+) tenant=(\S+) model=(\S+) -> (\S+) \(")


@pytest.fixture(scope="module")
def cluster_env() -> dict[str, str]:
    return {"HARLI_LOG_LEVEL": "INFO", "HARLI_GATEWAY_KEY_CACHE_TTL_S": "1"}


@pytest.fixture(scope="module")
def hosts_take_tenant_keys() -> bool:
    return False  # a tenant calling a host directly reaches nothing


@pytest.fixture
def redis_clean(cluster: Cluster) -> Iterator[None]:
    """Rate-limit buckets of earlier tests gone (tenants are created again with the same
    names)."""
    import redis

    client = redis.Redis.from_url(cluster.env["HARLI_RATE_LIMIT_REDIS_URL"])
    client.flushdb()
    yield
    client.close()


def _client(cluster: Cluster, key: str, **kwargs: Any) -> OpenAI:
    return OpenAI(base_url=f"{cluster.web_url}/v1", api_key=key, max_retries=0, timeout=30,
                  **kwargs)  # fmt: skip


def _routes(cluster: Cluster) -> list[tuple[str, str, str, str]]:
    """(request id, tenant, model, host) of every routing decision the web process logged."""
    text = cluster.procs["web"].log.read_text(errors="replace")
    return [m.groups() for m in ROUTE.finditer(text)]  # type: ignore[misc]


def _routed_since(cluster: Cluster, seen: int, model: str) -> list[str]:
    return [host for _, _, m, host in _routes(cluster)[seen:] if m == model]


def _fine_tune(client: OpenAI, cluster: Cluster) -> str:
    upload = client.files.create(file=("train.jsonl", training_jsonl()), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=upload.id, suffix="gw", seed=3,
        hyperparameters={"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 5},
    )  # fmt: skip

    def done() -> Any:
        current = client.fine_tuning.jobs.retrieve(job.id)
        if current.status in ("failed", "cancelled"):
            raise AssertionError(f"job {current.status}: {current.error}\n{cluster.logs()}")
        return current if current.status == "succeeded" else None

    finished = wait_until(done, 90, f"job {job.id} to succeed", every=0.5)
    assert finished.fine_tuned_model
    return str(finished.fine_tuned_model)


def test_fine_tune_and_chat_through_one_base_url(cluster: Cluster, seeded: Tenants) -> None:
    from api.models import HostAgentState

    client = _client(cluster, seeded.key)
    model = _fine_tune(client, cluster)
    assert model in [m.id for m in client.models.list()]

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Q: hello"}], max_tokens=4,
        temperature=0,
    )  # fmt: skip
    assert chat.model == model and chat.usage is not None
    assert 1 <= chat.usage.completion_tokens <= 4
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Q: hello"}], max_tokens=4,
            temperature=0, stream=True,
        )
    )  # fmt: skip
    assert all(c.usage is None for c in chunks)  # the client did not ask for the usage chunk
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    completion = client.completions.create(model=model, prompt="Q: hello", max_tokens=4,
                                           temperature=0)  # fmt: skip
    streamed = list(
        client.completions.create(
            model=model, prompt="Q: hello", max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text
    assert streamed[-1].usage is not None and completion.usage is not None
    assert streamed[-1].usage.completion_tokens == completion.usage.completion_tokens

    # The adapter is resident where it served; later requests for it keep going there while
    # that host has room, and the base model's requests spread over both hosts by load.
    def resident_on() -> list[str]:
        states = HostAgentState.objects.all()
        return [s.host.name for s in states if model in s.serving.get("resident_adapters", [])]

    home = wait_until(resident_on, 10, "a heartbeat naming the adapter resident")
    seen = len(_routes(cluster))
    for _ in range(4):
        client.completions.create(model=model, prompt="Q: hi", max_tokens=2)
    hosts = _routed_since(cluster, seen, model)
    # The first requests may have loaded the adapter on both hosts, their heartbeats read a
    # moment apart: a host counts as home if a heartbeat before or after these requests named
    # the adapter resident there (after: every host has reported since they were answered).
    answered = time.time()

    def reported_since() -> bool:
        states = list(HostAgentState.objects.all())
        return len(states) == 2 and all(
            s.reported_at is not None and s.reported_at.timestamp() > answered for s in states
        )

    wait_until(reported_since, 10, "a heartbeat of each host after the adapter's requests")
    home = [*home, *resident_on()]
    assert len(hosts) == 4 and set(hosts) <= set(home), (hosts, home)

    seen = len(_routes(cluster))
    results: list[str] = []

    def stream_base() -> None:
        out = client.completions.create(model="tiny", prompt="Q: numbers", max_tokens=48,
                                        stream=True)  # fmt: skip
        results.append("".join(c.choices[0].text for c in out if c.choices))

    threads = [threading.Thread(target=stream_base) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 8
    assert set(_routed_since(cluster, seen, "tiny")) == {"agent-a", "agent-b"}

    # Another tenant cannot call the adapter through the gateway, nor any model on a host.
    outsider = _client(cluster, seeded.other_key)
    with pytest.raises(openai.NotFoundError) as missing:
        outsider.completions.create(model=model, prompt="x", max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        _client(cluster, "hk-not-a-key").completions.create(model="tiny", prompt="x")
    direct = OpenAI(base_url=cluster.agent_url("agent-a"), api_key=seeded.key, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        direct.completions.create(model="tiny", prompt="x", max_tokens=2)


def test_a_client_that_disconnects_frees_the_request_on_its_host(
    cluster: Cluster, seeded: Tenants
) -> None:
    from api.models import HostAgentState

    body = {"model": "tiny", "prompt": "Q: once upon", "max_tokens": 400, "stream": True,
            "temperature": 1.0, "seed": 1}  # fmt: skip
    headers = {"authorization": f"Bearer {seeded.key}"}
    with httpx.Client(base_url=cluster.web_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data:")
                if events == 3:
                    break
        # closed with the request still decoding
    left = time.monotonic()

    def idle() -> bool:
        states = list(HostAgentState.objects.all())
        return bool(states) and all(
            s.serving.get("running") == 0
            and s.serving.get("kv_free_pages") == s.serving.get("kv_total_pages")
            for s in states
        )

    wait_until(idle, 10, "the hosts to report no running request and every KV page free")
    assert time.monotonic() - left < 10


def test_rate_limits_are_answered_as_openai_does_and_shared_by_two_gateways(
    cluster: Cluster, seeded: Tenants, redis_clean: None
) -> None:
    from api.models import Tenant
    from api.services.tenants import tenant_limits_set

    tenant_limits_set(tenant=Tenant.objects.get(name="acme"), requests_per_minute=4,
                      tokens_per_minute=None)  # fmt: skip
    time.sleep(1.2)  # the gateway's key cache (TTL 1 s here) picks the new limit up
    client = _client(cluster, seeded.key)
    remaining = []
    for _ in range(2):
        raw = client.completions.with_raw_response.create(model="tiny", prompt="hi",
                                                          max_tokens=2)  # fmt: skip
        assert raw.headers["x-ratelimit-limit-requests"] == "4"
        remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [3, 2]

    port = free_port()
    second = cluster.start_web("web2", port)
    try:
        wait_until(lambda: _ok(f"http://127.0.0.1:{port}/v1/models"), 60, "the second gateway")
        other = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=seeded.key, max_retries=0)
        for _ in range(2):
            other.completions.create(model="tiny", prompt="hi", max_tokens=2)
        for gateway in (client, other):
            with pytest.raises(openai.RateLimitError) as limited:
                gateway.completions.create(model="tiny", prompt="hi", max_tokens=2)
            error = limited.value
            assert error.code == "rate_limit_exceeded"
            assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
            assert int(error.response.headers["retry-after"]) >= 1
            assert error.response.headers["x-ratelimit-reset-requests"].endswith("s")
    finally:
        second.stop()
    # the other tenant has no limit
    _client(cluster, seeded.other_key).completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_usage_is_accounted_per_tenant_model_and_minute(cluster: Cluster, seeded: Tenants) -> None:
    from django.db.models import Sum

    from api.models import TenantUsage

    client = _client(cluster, seeded.key)
    used = [0, 0]
    for stream in (False, True):
        for _ in range(3):
            if stream:
                out = list(client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                    stream=True, stream_options={"include_usage": True},
                ))  # fmt: skip
                usage = out[-1].usage
            else:
                usage = client.completions.create(model="tiny", prompt="Q: hi", max_tokens=3).usage
            assert usage is not None
            used[0] += usage.prompt_tokens
            used[1] += usage.completion_tokens

    def recorded() -> Any:
        totals = TenantUsage.objects.filter(tenant__name="acme", model="tiny").aggregate(
            requests=Sum("requests"), prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
        )  # fmt: skip
        return totals if totals["requests"] == 6 else None

    totals = wait_until(recorded, 15, "the gateway to flush the usage")
    assert (totals["prompt"], totals["completion"]) == tuple(used)
    assert TenantUsage.objects.filter(tenant__name="acme").count() <= 2  # a row per minute
    assert not TenantUsage.objects.filter(tenant__name="globex").exists()

    page = httpx.get(
        f"{cluster.web_url}/v1/organization/usage/completions",
        params={"start_time": int(time.time()) - 3600, "bucket_width": "1h", "group_by": "model"},
        headers={"authorization": f"Bearer {seeded.key}"},
    ).json()
    results = [r for bucket in page["data"] for r in bucket["results"]]
    assert sum(r["input_tokens"] for r in results) == used[0]
    assert sum(r["output_tokens"] for r in results) == used[1]
    assert sum(r["num_model_requests"] for r in results) == 6


def test_a_killed_host_fails_only_the_streams_it_had_started(
    cluster: Cluster, seeded: Tenants
) -> None:
    client = _client(cluster, seeded.key)
    # every host serves the base model; kill one with streams open on both
    outcomes: list[str] = []
    started = threading.Barrier(9)

    def stream_one() -> None:
        try:
            out = client.completions.create(model="tiny", prompt="Q: numbers", max_tokens=300,
                                            stream=True, temperature=1.0)  # fmt: skip
            first = True
            for _ in out:
                if first:
                    first = False
                    started.wait(30)
            outcomes.append("ok")
        except (openai.APIError, threading.BrokenBarrierError) as exc:
            outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=stream_one) for _ in range(8)]
    for thread in threads:
        thread.start()
    started.wait(30)
    cluster.procs["agent-b"].stop(timeout=0)  # SIGKILL
    for thread in threads:
        thread.join(60)
    assert len(outcomes) == 8
    assert outcomes.count("ok") >= 1 and set(outcomes) <= {"ok", "APIError"}, outcomes
    # new requests all succeed on the survivor, also before the host is declared lost
    for _ in range(6):
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


def test_no_process_logs_the_brokers_password(cluster: Cluster, seeded: Tenants) -> None:
    """Redis requires a password here as in production; no process writes it to its log, and
    no command line carries it (the agents read the broker URL from their environment)."""
    for proc in cluster.procs.values():
        assert cluster.redis_password not in proc.log.read_text(errors="replace"), proc.name
        assert cluster.redis_password not in str(proc.popen.args), proc.name
