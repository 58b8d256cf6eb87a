"""Schemathesis over both APIs, against the real app served over a socket (pytest-django's
`live_server`, on the test database).

Every operation of the OpenAPI document gets a fixed, seeded budget of generated requests,
valid and invalid (`GenerationMode` positive and negative), sent with a tenant's API key on
`/v1` and an operator's on `/api/ops/`. A request fails the test when the answer is a 5xx,
has a status the operation does not document, or does not match the documented body or
content type. A request with path parameters is sent again with them naming objects that
exist (`World`), so detail routes answer on real objects as well as with their 404s.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.services.apikeys import api_key_issue, api_key_issue_for_tenant
from api.services.files import UploadSource, file_create
from api.services.fleet import base_model_register, deployment_create, host_register
from api.services.jobs import finetune_job_create
from api.services.tenants import operator_create, tenant_create
from api.services.uploads import upload_create
from tests.api.conftest import VALID_JSONL

EXAMPLES_PER_OPERATION = 25
SEED = 27
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

pytestmark = pytest.mark.timeout(300)


def _document() -> dict[str, Any]:
    document = SchemaGenerator().get_schema(request=None, public=True)
    assert isinstance(document, dict)
    return document


schema = schemathesis.openapi.from_dict(
    _document(),
    config=schemathesis.Config.from_dict(
        {"seed": SEED, "generation": {"max-examples": EXAMPLES_PER_OPERATION}}
    ),
)


class World:
    """What the live server's database holds for one generated test: a tenant with a file, a
    job and an upload; an operator; a base model, a deployment and a host."""

    def __init__(self) -> None:
        tenant = tenant_create(name="acme")
        issued = api_key_issue_for_tenant(tenant=tenant)
        self.tenant_key = issued.key
        self.operator_key = api_key_issue(
            user=operator_create(username="ops", password="s3cret-pass")
        ).key
        tiny = base_model_register(name="tiny", preset="tiny")
        deployment = deployment_create(
            name="chat", base_model=tiny, tpot_slo_ms=50.0, ttft_slo_ms=500.0
        )
        host_register(name="gpu-0", gpu_kind="H200", gpu_memory_bytes=2**37, deployment=deployment)
        training = file_create(
            tenant=tenant,
            purpose="fine-tune",
            upload=UploadSource.from_bytes(filename="train.jsonl", data=VALID_JSONL),
        )
        job = finetune_job_create(tenant=tenant, model="tiny", training_file=training.id)
        upload = upload_create(
            tenant=tenant,
            filename="big.jsonl",
            purpose="fine-tune",
            declared_bytes=len(VALID_JSONL),
            mime_type="text/jsonl",
        )
        self.path_ids = {
            "file_id": training.id,
            "fine_tuning_job_id": job.id,
            "job_id": job.id,
            "upload_id": upload.id,
            "model": "tiny",
            "key_id": issued.api_key.pk,
        }
        self.names = {
            "/api/ops/tenants/": "acme",
            "/api/ops/basemodels/": "tiny",
            "/api/ops/deployments/": "chat",
            "/api/ops/hosts/": "gpu-0",
        }

    def existing(self, case: schemathesis.Case) -> dict[str, Any] | None:
        """The case's path parameters pointed at this world's objects, or None (no path
        parameter names one)."""
        if not case.path_parameters:
            return None
        known = dict(self.path_ids)
        prefix = next((p for p in self.names if case.path.startswith(p)), None)
        if prefix is not None:
            known["name"] = self.names[prefix]
        replaced = {name: known.get(name, value) for name, value in case.path_parameters.items()}
        return replaced if replaced != case.path_parameters else None


@pytest.fixture
def world(live_server: Any, transactional_db: None) -> World:
    return World()


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_its_schema(
    case: schemathesis.Case, world: World, live_server: Any
) -> None:
    """The generated request, then (on a route with path parameters) the same request on the
    world's objects."""
    key = world.operator_key if case.path.startswith("/api/ops/") else world.tenant_key
    headers = {"Authorization": f"Bearer {key}"}
    case.call_and_validate(base_url=live_server.url, headers=headers, checks=CHECKS, timeout=30)
    existing = world.existing(case)
    if existing is not None:
        case.path_parameters = existing
        case.call_and_validate(base_url=live_server.url, headers=headers, checks=CHECKS, timeout=30)
