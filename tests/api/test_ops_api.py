"""`/api/ops/`: the operator's view of the fleet and of every tenant's jobs; schema and docs."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from api.models import File, GpuHost, Tenant
from api.services.jobs import finetune_job_create
from tests.api.conftest import ApiClient, assert_error

pytestmark = pytest.mark.django_db


def test_fleet_registration_and_listing(ops: ApiClient) -> None:
    created = ops.post("/api/ops/basemodels", {"name": "tiny", "preset": "tiny"})
    assert created.status_code == 201, created.content
    assert created.json()["config"]["hidden_size"] == 64
    assert_error(ops.post("/api/ops/basemodels", {"name": "x"}), 400)
    deployment = ops.post(
        "/api/ops/deployments",
        {"name": "tiny-chat", "base_model": "tiny", "tpot_slo_ms": 50, "ttft_slo_ms": 500},
    )
    assert deployment.status_code == 201, deployment.content
    assert deployment.json()["slo_attainment_target_pct"] == 99.0
    host = ops.post(
        "/api/ops/hosts",
        {
            "name": "gpu-0",
            "gpu_kind": "H200",
            "gpu_memory_bytes": 141 * 2**30,
            "deployment": "tiny-chat",
        },
    ).json()
    assert host["status"] == "offline" and host["queue_name"] == "host.gpu-0"
    assert host["predictor_version"] is None
    drained = ops.post("/api/ops/hosts/gpu-0/drain").json()
    assert drained["status"] == "draining"
    assert GpuHost.objects.get().status == "draining"
    assert [h["name"] for h in ops.get("/api/ops/hosts?status=draining").json()["data"]] == [
        "gpu-0"
    ]
    # Back in service: offline until its first heartbeat (it never sent one); idempotent.
    assert ops.post("/api/ops/hosts/gpu-0/undrain").json()["status"] == "offline"
    assert ops.post("/api/ops/hosts/gpu-0/undrain").json()["status"] == "offline"
    assert_error(ops.post("/api/ops/hosts/nope/undrain"), 404)
    GpuHost.objects.filter(name="gpu-0").update(status="lost")
    assert assert_error(ops.post("/api/ops/hosts/gpu-0/undrain"), 409)["code"] == "host_lost"
    assert [d["name"] for d in ops.get("/api/ops/deployments").json()["data"]] == ["tiny-chat"]
    assert ops.get("/api/ops/basemodels/tiny").json()["architecture"] == "llama"
    assert ops.get("/api/ops/placements").json()["data"] == []
    assert host["harvestable_tokens_per_s"] is None and host["harvest"] is None


def test_hosts_show_the_predictor_and_harvest_estimate_their_agent_reports(ops: ApiClient) -> None:
    from api.services.fleet import base_model_register, deployment_create, host_register
    from tests.api.services.conftest import heartbeat

    tiny = base_model_register(name="tiny", preset="tiny")
    chat = deployment_create(name="tiny-chat", base_model=tiny, tpot_slo_ms=50, ttft_slo_ms=500)
    host_register(name="gpu-0", gpu_kind="H200", gpu_memory_bytes=2**37, deployment=chat)
    harvest = {"source": "predictor", "finetune_fraction": 0.75, "mode": "spatial 0.75",
               "solo_tokens_per_s": 12000.0, "solo_source": "prior"}  # fmt: skip
    applied = heartbeat(
        "gpu-0", harvestable_tokens_per_s=9000.0, harvest=harvest,
        predictor_version="v20261130T095333Z", predictor_mape=0.032,
    )  # fmt: skip
    assert applied == "applied"
    (listed,) = ops.get("/api/ops/hosts").json()["data"]
    detail = ops.get("/api/ops/hosts/gpu-0").json()
    for host in (listed, detail):
        assert host["predictor_version"] == "v20261130T095333Z"
        assert host["predictor_mape"] == 0.032
        assert host["harvestable_tokens_per_s"] == 9000.0
        assert host["harvest"] == harvest
        assert host["engine"] == "harli" and host["capabilities"]["colocation"] is True
    caps = {"colocation": False, "architectures": ["MistralForCausalLM"], "max_loras": 4,
            "max_lora_rank": 16}  # fmt: skip
    heartbeat("gpu-0", engine="vllm", capabilities=caps, engine_state={"state": "ready",
              "restarts": 1})  # fmt: skip
    detail = ops.get("/api/ops/hosts/gpu-0").json()
    assert detail["engine"] == "vllm"
    assert detail["capabilities"] == caps | {"engine_state": {"state": "ready", "restarts": 1}}


def test_deployments_of_architectures_only_vllm_serves(ops: ApiClient, tmp_path: Any) -> None:
    import json

    checkpoint = tmp_path / "mistral"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(
        json.dumps({"model_type": "mistral", "max_position_embeddings": 32768})
    )
    created = ops.post("/api/ops/basemodels", {"name": "m7", "checkpoint_dir": str(checkpoint)})
    assert created.status_code == 201, created.content
    assert created.json()["architecture"] == "mistral"
    body = {"name": "m-chat", "base_model": "m7", "tpot_slo_ms": 50, "ttft_slo_ms": 500}
    error = assert_error(ops.post("/api/ops/deployments", body), 400, param="engine")
    assert error["code"] == "architecture_needs_vllm"
    assert "--engine vllm" in error["message"]
    assert ops.get("/api/ops/deployments").json()["data"] == []
    assert_error(ops.post("/api/ops/deployments", body | {"engine": "tgi"}), 400, param="engine")
    made = ops.post("/api/ops/deployments", body | {"engine": "vllm"})
    assert made.status_code == 201, made.content
    assert made.json()["engine"] == "vllm"
    assert ops.get("/api/ops/deployments/m-chat").json()["engine"] == "vllm"


def test_tenants_and_keys(ops: ApiClient) -> None:
    assert ops.post("/api/ops/tenants", {"name": "initech"}).status_code == 201
    issued = ops.post("/api/ops/apikeys", {"tenant": "initech", "name": "ci"}).json()
    key = issued["key"]
    assert key.startswith(issued["api_key"]["prefix"])
    assert ApiClient(key).get("/v1/models").status_code == 200
    listed = ops.get("/api/ops/apikeys?tenant=initech").json()["data"]
    assert [k["prefix"] for k in listed] == [issued["api_key"]["prefix"]]
    assert "key" not in listed[0] and "digest" not in listed[0]
    revoked = ops.post(f"/api/ops/apikeys/{issued['api_key']['id']}/revoke").json()
    assert revoked["revoked_at"] is not None
    assert ApiClient(key).get("/v1/models").status_code == 401
    assert_error(ops.post("/api/ops/apikeys", {"tenant": "initech", "operator": "ops"}), 400)


def test_jobs_of_every_tenant(
    ops: ApiClient,
    tenant: Tenant,
    other_tenant: Tenant,
    training_file: File,
    tiny: object,
    django_capture_on_commit_callbacks: Any,
) -> None:
    from api.services.files import UploadSource, file_create
    from tests.api.conftest import VALID_JSONL

    other_file = file_create(
        tenant=other_tenant,
        purpose="fine-tune",
        upload=UploadSource.from_bytes(filename="t.jsonl", data=VALID_JSONL),
    )
    mine = finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)
    theirs = finetune_job_create(tenant=other_tenant, model="tiny", training_file=other_file.id)
    listed = ops.get("/api/ops/jobs").json()["data"]
    assert {j["id"] for j in listed} == {mine.id, theirs.id}
    only = ops.get("/api/ops/jobs?tenant=globex").json()["data"]
    assert [j["id"] for j in only] == [theirs.id]
    assert ops.get(f"/api/ops/jobs/{mine.id}").json()["tenant"] == "acme"
    assert ops.post(f"/api/ops/jobs/{mine.id}/cancel").json()["status"] == "cancelled"
    assert_error(ops.post(f"/api/ops/jobs/{mine.id}/cancel"), 409)


def test_schema_and_swagger_ui_are_served_offline() -> None:
    schema = Client().get("/api/schema/?format=json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for route in (
        "/v1/files",
        "/v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints",
        "/v1/models",
        "/api/ops/hosts/{name}/drain",
        "/api/ops/hosts/{name}/undrain",
    ):
        assert route in paths
    docs = Client().get("/api/docs/")
    assert docs.status_code == 200
    html = docs.content.decode()
    assert "swagger-ui" in html and "/static/drf_spectacular_sidecar/" in html
    assert "cdn.jsdelivr" not in html


def test_schema_generates_without_warnings(tmp_path: Any) -> None:
    from django.core.management import call_command

    out = tmp_path / "schema.yml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    assert "/v1/fine_tuning/jobs:" in out.read_text()


def test_list_filters_with_an_unknown_value_are_refused(ops: ApiClient) -> None:
    """A typo in a filter is a 400 naming the parameter and the values it takes, not an
    empty list that reads as "nothing matched"."""
    for path, param in (
        ("/api/ops/jobs?status=runing", "status"),
        ("/api/ops/hosts?status=up", "status"),
        ("/api/ops/placements?state=open", "state"),
    ):
        error = assert_error(ops.get(path), 400, param=param)
        assert error["code"] == "invalid_value"
        assert f"got '{path.rsplit('=', 1)[1]}'" in error["message"]
    assert "queued, running" in assert_error(ops.get("/api/ops/jobs?status=x"), 400)["message"]
    for path in (
        "/api/ops/jobs?status=running",
        "/api/ops/jobs?status=",
        "/api/ops/hosts?status=draining",
        "/api/ops/placements?state=active",
    ):
        response = ops.get(path)
        assert response.status_code == 200 and response.json()["data"] == []
