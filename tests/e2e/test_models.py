"""End to end on CPU with real processes, through the `openai` client: a finished job's
checkpoint answers by its `fine_tuned_model_checkpoint` name on the hosts (for its tenant
only), its adapter downloads as a PEFT archive, and deleting the model (then the checkpoint)
makes every host answer 404 for it, with no heartbeat bringing it back. Before the deletion an
operator unloads the adapter from one host and loads it back (`/api/ops/hosts/.../adapters`)."""

from __future__ import annotations

import io
import tarfile
from datetime import timedelta
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.cluster import Cluster, wait_until
from tests.e2e.conftest import AGENTS, Tenants, training_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def cluster_env() -> dict[str, str]:
    # The job's checkpoints at steps 10 and 12 are both kept: step 10's is called by name.
    return {"HARLI_KEEP_CHECKPOINTS": "3"}


def _client(url: str, key: str) -> OpenAI:
    return OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)


def _refused(agent: OpenAI, model: str) -> bool:
    try:
        agent.completions.create(model=model, prompt="Q: hello", max_tokens=2)
    except openai.NotFoundError:
        return True
    return False


def _lists(agent: OpenAI, model: str) -> bool:
    return model in [m.id for m in agent.models.list()]


def _operator_unloads_and_loads_again(
    cluster: Cluster, agents: dict[str, OpenAI], model: str
) -> None:
    """An operator takes `model` off agent-b through `/api/ops/`, without a restart: agent-b
    refuses it and its heartbeats do not bring it back while agent-a keeps serving it; a load
    puts it back."""
    from django.utils import timezone

    from api.models import HostAgentState
    from api.services.apikeys import api_key_issue
    from api.services.tenants import operator_create

    user = operator_create(username="e2e-ops", password="e2e-ops-password")
    headers = {"Authorization": f"Bearer {api_key_issue(user=user).key}"}
    base = f"{cluster.web_url}/api/ops/hosts/agent-b/adapters"
    unloaded = httpx.post(f"{base}/unload", json={"model": model}, headers=headers, timeout=30)
    assert unloaded.status_code == 202, unloaded.text
    wait_until(partial(_refused, agents["agent-b"], model), 10, "agent-b to refuse the model")
    after = timezone.now() + timedelta(seconds=2)  # 4 heartbeats at 0.5 s
    wait_until(lambda: HostAgentState.objects.filter(host__name="agent-b",
                                                     reported_at__gt=after).exists(),
               30, "agent-b's heartbeats after the unload")  # fmt: skip
    assert _refused(agents["agent-b"], model)
    assert agents["agent-a"].completions.create(model=model, prompt="Q: hi", max_tokens=2).choices
    listed = httpx.get(base, headers=headers, timeout=30).json()["data"]
    entries = {e["name"]: (e["served"], e["order"]) for e in listed}  # with the checkpoint
    assert entries[model] == (False, "unload")
    loaded = httpx.post(f"{base}/load", json={"model": model}, headers=headers, timeout=30)
    assert loaded.status_code == 202, loaded.text
    wait_until(partial(_lists, agents["agent-b"], model), 20, "agent-b to serve it again")
    assert agents["agent-b"].completions.create(model=model, prompt="Q: hi", max_tokens=2).choices


def test_checkpoint_serves_by_name_and_deleted_models_leave_every_host(
    cluster: Cluster, seeded: Tenants
) -> None:
    from django.utils import timezone

    from api.models import HostAgentState

    client = _client(f"{cluster.web_url}/v1", seeded.key)
    upload = client.files.create(file=("train.jsonl", training_jsonl()), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=upload.id, suffix="models", seed=7,
        hyperparameters={"n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": 5},
    )  # fmt: skip

    def succeeded() -> object:
        current = client.fine_tuning.jobs.retrieve(job.id)
        assert current.status not in ("failed", "cancelled"), current.error
        return current if current.status == "succeeded" else None

    try:
        job = wait_until(succeeded, 90, f"job {job.id} to succeed", every=0.5)
    except AssertionError:
        print(cluster.logs())
        raise
    model = job.fine_tuned_model
    assert model is not None
    checkpoint = next(
        c for c in client.fine_tuning.jobs.checkpoints.list(job.id) if c.step_number == 10
    )
    ckpt_model = checkpoint.fine_tuned_model_checkpoint
    assert ckpt_model == f"{model}:ckpt-step-10"
    assert client.models.retrieve(ckpt_model).id == ckpt_model
    assert ckpt_model not in [m.id for m in client.models.list()]

    # The checkpoint by name, on every host: loaded on its first request, for its tenant only.
    for host in AGENTS:
        agent = _client(cluster.agent_url(host), seeded.key)
        chat = agent.chat.completions.create(
            model=ckpt_model, messages=[{"role": "user", "content": "Q: hello"}], max_tokens=4,
            temperature=0,
        )  # fmt: skip
        assert chat.model == ckpt_model and chat.usage is not None
        assert chat.usage.completion_tokens >= 1
        assert ckpt_model not in [m.id for m in agent.models.list()]  # never listed
        outsider = _client(cluster.agent_url(host), seeded.other_key)
        assert _refused(outsider, ckpt_model)

    # The adapter as a PEFT archive.
    download = httpx.get(f"{cluster.web_url}/v1/models/{model}/content", timeout=30,
                         headers={"Authorization": f"Bearer {seeded.key}"})  # fmt: skip
    assert download.status_code == 200, download.text
    with tarfile.open(fileobj=io.BytesIO(download.content), mode="r:gz") as archive:
        files = sorted(n.split("/", 1)[1] for n in archive.getnames() if "/" in n)
    assert files == ["adapter_config.json", "adapter_model.safetensors"]

    agents = {host: _client(cluster.agent_url(host), seeded.key) for host in AGENTS}
    for host, agent in agents.items():
        wait_until(partial(_lists, agent, model), 20, f"{host} to serve the adapter")
        assert agent.completions.create(model=model, prompt="Q: hi", max_tokens=2).choices

    _operator_unloads_and_loads_again(cluster, agents, model)

    deleted = client.models.delete(model)
    assert (deleted.id, deleted.deleted) == (model, True)
    assert model not in [m.id for m in client.models.list()]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(model)
    assert client.fine_tuning.jobs.retrieve(job.id).fine_tuned_model == model
    storage = Path(cluster.env["HARLI_STORAGE_DIR"])
    wait_until(lambda: not (storage / "adapters" / job.id).exists(), 10, "the bytes to go")
    for host, agent in agents.items():
        wait_until(partial(_refused, agent, model), 10, f"{host} to refuse {model}")
        assert model not in [m.id for m in agent.models.list()]
    # The checkpoint is a model of its own: still served until it is deleted too.
    assert agents["agent-a"].completions.create(model=ckpt_model, prompt="x", max_tokens=2)
    assert client.models.delete(ckpt_model).deleted
    for host, agent in agents.items():
        wait_until(partial(_refused, agent, ckpt_model), 10, f"{host} to refuse the ckpt")

    # Heartbeats do not bring either back: wait until each host's heartbeats of the next 2 s
    # (4 at 0.5 s) have been applied, however far behind the worker runs.
    after = timezone.now() + timedelta(seconds=2)

    def heartbeat_applied(host: str) -> bool:
        state = HostAgentState.objects.filter(host__name=host, reported_at__gt=after)
        return state.exists()

    for host in AGENTS:
        wait_until(partial(heartbeat_applied, host), 30, f"{host}'s heartbeats after the deletes")
    for host, agent in agents.items():
        assert _refused(agent, model) and _refused(agent, ckpt_model)
        served = HostAgentState.objects.get(host__name=host).adapters
        assert model not in served and ckpt_model not in served, (host, served)
