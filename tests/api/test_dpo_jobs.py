"""DPO jobs: OpenAI's `method: {"type": "dpo"}` and preference files, through the API, the
official `openai` client and the JobSpec a host receives."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from api.models import BaseModel, File, FinetuneJob, JobEvent, Tenant
from api.services.apikeys import api_key_issue_for_tenant
from api.services.files import UploadSource, file_create
from api.services.fleet import base_model_register
from api.services.placement_dispatch import job_spec
from api.services.tenants import tenant_create
from gpu_runtime.contract.protocol import ProtocolError, check_command
from tests.api.conftest import VALID_JSONL, ApiClient, assert_error, jsonl

PREFERENCE_LINE: dict[str, Any] = {
    "input": {
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "tools": [],
        "parallel_tool_calls": True,
    },
    "preferred_output": [{"role": "assistant", "content": "Paris."}],
    "non_preferred_output": [{"role": "assistant", "content": "Lyon, I think."}],
}
PREFERENCE_JSONL = jsonl(PREFERENCE_LINE, PREFERENCE_LINE)


def dpo(**hyperparameters: Any) -> dict[str, Any]:
    return {"type": "dpo", "dpo": {"hyperparameters": hyperparameters}}


@pytest.fixture
def preference_file(tenant: Tenant) -> File:
    return file_create(
        tenant=tenant,
        purpose="fine-tune",
        upload=UploadSource.from_bytes(filename="prefs.jsonl", data=PREFERENCE_JSONL),
    )


def create(api: ApiClient, file: File, **extra: Any) -> Any:
    return api.post("/v1/fine_tuning/jobs", {"model": "tiny", "training_file": file.id, **extra})


@pytest.mark.django_db
def test_dpo_job_is_stored_rendered_and_sent_to_the_host(
    api: ApiClient, preference_file: File, tiny: BaseModel
) -> None:
    assert preference_file.format == "preference" and preference_file.line_count == 2
    response = create(api, preference_file, method=dpo(beta=0.25, n_epochs=2))
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["method"] == {
        "type": "dpo",
        "dpo": {
            "hyperparameters": {
                "n_epochs": 2,
                "batch_size": "auto",
                "learning_rate_multiplier": "auto",
                "beta": 0.25,
            }
        },
    }
    job = FinetuneJob.objects.get(pk=body["id"])
    assert (job.method, job.dpo_beta) == ("dpo", 0.25)
    spec = job_spec(job=job, resume=None)
    assert spec["method"] == "dpo" and spec["hyperparameters"]["beta"] == 0.25
    command = {"command": "apply_placement", "command_id": "c", "placement_id": 1, "job": spec}
    check_command(command)
    with pytest.raises(ProtocolError, match="method"):
        check_command({**command, "job": {**spec, "method": "reinforcement"}})
    auto = FinetuneJob.objects.get(pk=create(api, preference_file, method=dpo()).json()["id"])
    assert auto.dpo_beta == "auto" and job_spec(job=auto, resume=None)["hyperparameters"]["beta"]


@pytest.mark.django_db
def test_a_dpo_job_takes_a_preference_validation_file(
    api: ApiClient, preference_file: File, tenant: Tenant, tiny: BaseModel
) -> None:
    other = file_create(
        tenant=tenant,
        purpose="fine-tune",
        upload=UploadSource.from_bytes(filename="valid.jsonl", data=PREFERENCE_JSONL),
    )
    response = create(api, preference_file, method=dpo(), validation_file=other.id)
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["validation_file"], body["status"]) == (other.id, "queued")
    spec = job_spec(job=FinetuneJob.objects.get(pk=body["id"]), resume=None)
    assert spec["method"] == "dpo" and spec["validation_file"] == other.id
    assert spec["validation_file_key"] == other.storage_key


@pytest.mark.django_db
def test_a_supervised_job_keeps_its_spec(
    api: ApiClient, training_file: File, tiny: BaseModel
) -> None:
    body = create(api, training_file, hyperparameters={"n_epochs": 1}).json()
    assert body["method"]["type"] == "supervised"
    spec = job_spec(job=FinetuneJob.objects.get(pk=body["id"]), resume=None)
    assert spec["method"] == "supervised" and "beta" not in spec["hyperparameters"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("train", "extra", "param", "says"),
    [
        ("preference", {}, "training_file", "only a DPO job"),
        ("preference", {"method": {"type": "supervised"}}, "training_file", "only a DPO job"),
        ("chat", {"method": dpo()}, "training_file", "needs a preference file"),
        ("preference", {"method": dpo(), "validation_file": "chat"}, "validation_file", "DPO"),
        ("chat", {"validation_file": "pref"}, "validation_file", "only a DPO job"),
        ("preference", {"method": dpo(), "hyperparameters": {}}, "hyperparameters", "method.dpo"),
        ("preference", {"method": dpo(warmup=1)}, "hyperparameters.warmup", "warmup"),
    ],
)
def test_mismatched_files_and_settings_are_refused(
    api: ApiClient,
    training_file: File,
    preference_file: File,
    tiny: BaseModel,
    train: str,
    extra: dict[str, Any],
    param: str,
    says: str,
) -> None:
    valid = {"pref": preference_file.id, "chat": training_file.id}
    if extra.get("validation_file") in valid:
        extra = {**extra, "validation_file": valid[extra["validation_file"]]}
    file = preference_file if train == "preference" else training_file
    error = assert_error(create(api, file, **extra), 400, param=param)
    assert says in error["message"]
    assert not FinetuneJob.objects.exists() and not JobEvent.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("line", "says"),
    [
        ({**PREFERENCE_LINE, "input": {"messages": [], "tools": []}}, "input.messages"),
        (
            {**PREFERENCE_LINE, "input": {**PREFERENCE_LINE["input"], "tools": [{"x": 1}]}},
            "input.tools is not supported",
        ),
        ({**PREFERENCE_LINE, "preferred_output": []}, "preferred_output"),
        (
            {**PREFERENCE_LINE, "non_preferred_output": [{"role": "user", "content": "x"}]},
            "non_preferred_output[0].role",
        ),
        ({**PREFERENCE_LINE, "weight": 1}, "unsupported field"),
        ({**PREFERENCE_LINE, "messages": []}, "unsupported field"),
    ],
)
def test_bad_preference_lines_are_refused_at_upload(
    api: ApiClient, line: dict[str, Any], says: str
) -> None:
    error = assert_error(api.upload(jsonl(PREFERENCE_LINE, line)), 400, param="file")
    assert "line 2" in error["message"] and says in error["message"], error["message"]


@pytest.mark.django_db(transaction=True)
def test_openai_client_creates_a_dpo_job(live_server: Any) -> None:
    base_model_register(name="tiny", preset="tiny")
    key = api_key_issue_for_tenant(tenant=tenant_create(name="acme")).key
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0)
    prefs = client.files.create(file=("prefs.jsonl", PREFERENCE_JSONL), purpose="fine-tune")
    assert prefs.status == "processed"
    job = client.fine_tuning.jobs.create(
        model="tiny",
        training_file=prefs.id,
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}},
    )
    assert job.status == "queued"
    assert job.method is not None and job.method.type == "dpo"
    assert job.method.dpo is not None and job.method.dpo.hyperparameters is not None
    assert job.method.dpo.hyperparameters.beta == 0.1
    assert client.fine_tuning.jobs.retrieve(job.id).method.type == "dpo"  # type: ignore[union-attr]
    chat = client.files.create(file=("train.jsonl", VALID_JSONL), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.jobs.create(
            model="tiny", training_file=chat.id, method={"type": "dpo", "dpo": {}}
        )
    assert refused.value.param == "training_file"
    with pytest.raises(openai.BadRequestError) as supervised:
        client.fine_tuning.jobs.create(model="tiny", training_file=prefs.id)
    assert supervised.value.param == "training_file"


@pytest.mark.django_db
def test_a_dpo_job_is_charged_two_rows_of_activations_per_example(tenant: Tenant) -> None:
    from api.services.placement import finetune_memory_estimate
    from gpu_runtime.contract.footprint import ACTIVATION_BYTES_PER_UNIT

    llama = base_model_register(name="llama", preset="llama3-8b")
    settings = {"n_epochs": "auto", "batch_size": 4, "learning_rate_multiplier": "auto"}

    def estimate(method: str) -> int:
        job = FinetuneJob(
            tenant=tenant, base_model=llama, hyperparameters=settings, method=method, seed=0
        )
        return finetune_memory_estimate(job=job)

    config = llama.config
    assert config is not None
    one_row = 4 * 2048 * config["hidden_size"] * config["num_hidden_layers"]
    assert estimate("dpo") - estimate("supervised") == one_row * ACTIVATION_BYTES_PER_UNIT
