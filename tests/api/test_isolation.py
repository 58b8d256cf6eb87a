"""Tenant isolation, checked over every route of the URL conf.

Each route is classified by prefix. Under `v1/` every path parameter is filled with an object of
ANOTHER tenant and every allowed method must answer 404 (and the owner must not get a 404, so
the filler is known to be real). Tenant list routes must not show the other tenant's objects;
tenant create routes must refuse the other tenant's objects. Operator-only prefixes must refuse
a tenant key. Anything else must be listed in EXEMPT with a reason; an unclassified route, or a
path parameter with no filler, fails the test, so a new endpoint is covered without anyone
remembering to add it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from api.models import File, FinetuneJob, Tenant
from api.services.apikeys import api_key_issue_for_tenant
from api.services.files import UploadSource, file_create
from api.services.jobs import (
    finetune_job_create,
    finetune_job_start,
    finetune_job_succeed,
    job_checkpoint_record,
)
from api.services.uploads import upload_create, upload_part_add
from api.services.usage import UsageRow, usage_record_batch
from api.storage import get_storage
from gpu_runtime.contract.protocol import adapter_key, checkpoint_key
from gpu_runtime.contract.storage import COMPLETE_MARKER
from tests.api.conftest import VALID_JSONL, ApiClient

pytestmark = pytest.mark.django_db

TENANT_PREFIX = "v1/"
OPERATOR_ONLY_PREFIXES = ("api/ops/", "console/")
# A tenant key on an operator-only route: refused, or sent to the operator login page.
OPERATOR_ONLY_REFUSALS = {302, 401, 403}
EXEMPT = {
    "": "redirects to the operator console; no data",
    "healthz": "liveness probe: {\"status\": \"ok\"}; touches no data",
    "metrics": "Prometheus scrape: the operator's HARLI_METRICS_TOKEN, never a tenant key (404 "
    "without a token set); tenants' names appear only as labels of counts",
    "readyz": "readiness probe: the database and broker answer or not; no tenant data",
    "api/schema/": "the public OpenAPI document; describes routes, holds no tenant data",
    "api/docs/": "Swagger UI page; loads the public schema only",
    "api/auth/login/": "operator session login form; no tenant data",
    "api/auth/logout/": "ends the caller's own session; no tenant data",
    "console/login/": "operator console login form; no tenant data",
    "console/logout/": "ends the caller's own console session; no tenant data",
}
METHODS = ("get", "post", "put", "patch", "delete")
# Collection routes that answer only with query parameters (a usage read needs its time range):
# the query that reads everything the last day holds, grouped so model names show.
COLLECTION_QUERIES = {
    "v1/organization/usage/completions": (
        "?start_time={day_ago}&bucket_width=1h&limit=48&group_by=model"
    ),
}
PARAM = re.compile(r"<(?:(?P<converter>\w+):)?(?P<name>\w+)>")


@dataclass(frozen=True)
class Route:
    route: str  # e.g. "v1/files/<str:file_id>"
    view: Any

    @property
    def params(self) -> list[str]:
        return [m.group("name") for m in PARAM.finditer(self.route)]

    @property
    def methods(self) -> list[str]:
        view_class = getattr(self.view, "cls", None) or getattr(self.view, "view_class", None)
        if view_class is None:  # a function view: assume it answers everything
            return list(METHODS)
        return [m for m in METHODS if hasattr(view_class, m)]

    def url(self, values: dict[str, str]) -> str:
        return "/" + PARAM.sub(lambda m: values[m.group("name")], self.route)


def walk(patterns: list[Any], prefix: str = "") -> Iterator[Route]:
    for pattern in patterns:
        text = str(pattern.pattern)
        assert not text.startswith("^"), f"regex route {prefix}{text}: use path() so it is walkable"
        if isinstance(pattern, URLResolver):
            yield from walk(pattern.url_patterns, prefix + text)
        else:
            assert isinstance(pattern, URLPattern)
            yield Route(route=prefix + text, view=pattern.callback)


def _store_peft_tree(key: str) -> None:
    """PEFT-shaped files under `key` (the downloads only stream them)."""
    storage = get_storage()
    storage.save(f"{key}/adapter_config.json", [b'{"peft_type": "LORA"}'])
    storage.save(f"{key}/adapter_model.safetensors", [b"weights"])
    storage.save(f"{key}/{COMPLETE_MARKER}", [b"ok"])


@dataclass
class Victim:
    tenant: Tenant
    key: str
    file: File
    job: FinetuneJob
    fillers: dict[str, str]


@pytest.fixture
def victim(tiny: object, other_tenant: Tenant) -> Victim:
    """Another tenant with one object of every kind a tenant route can name."""
    tenant = other_tenant
    file = file_create(
        tenant=tenant,
        purpose="fine-tune",
        upload=UploadSource.from_bytes(filename="secret.jsonl", data=VALID_JSONL),
    )
    job = finetune_job_create(tenant=tenant, model="tiny", training_file=file.id, suffix="x")
    job = finetune_job_start(job=job)
    job_checkpoint_record(job=job, step=1, metrics={"train_loss": 1.0})
    _store_peft_tree(adapter_key(job.id))
    finished = finetune_job_succeed(job=job, trained_tokens=10, adapter_path=adapter_key(job.id))
    running = finetune_job_create(tenant=tenant, model="tiny", training_file=file.id)
    _store_peft_tree(checkpoint_key(running.id, 3))
    checkpoint = job_checkpoint_record(
        job=running, step=3, metrics={"train_loss": 1.0}, path=checkpoint_key(running.id, 3)
    )
    assert finished.fine_tuned_model is not None
    upload = upload_create(
        tenant=tenant,
        filename="big.jsonl",
        purpose="fine-tune",
        declared_bytes=len(VALID_JSONL),
        mime_type="text/jsonl",
    )
    upload_part_add(upload=upload, data=UploadSource.from_bytes(filename="p", data=VALID_JSONL))
    minute = datetime.now(tz=UTC).replace(second=0, microsecond=0)
    usage_record_batch(
        rows=[
            UsageRow(
                tenant_id=tenant.pk,
                model=finished.fine_tuned_model,
                minute=minute,
                requests=1,
                prompt_tokens=10,
                completion_tokens=5,
            )
        ]
    )
    fillers = {
        "file_id": file.id,
        "fine_tuning_job_id": running.id,
        "model": finished.fine_tuned_model,
        "upload_id": upload.id,
        "checkpoint_id": checkpoint.id,
        # operator-only routes
        "name": tenant.name,
        "job_id": running.id,
        "key_id": str(tenant.users.get().api_keys.get().pk),
        "index": "0",  # a host's engine group
        "action": "cancel",  # console job actions
        "chart": "loss",  # console chart names
    }
    return Victim(tenant=tenant, key="", file=file, job=running, fillers=fillers)


@pytest.fixture
def victim_with_key(other_tenant: Tenant, other_key: str, victim: Victim) -> Victim:
    victim.key = other_key
    return victim


def all_routes() -> list[Route]:
    return list(walk(get_resolver().url_patterns))


def test_every_route_is_classified() -> None:
    unknown = [
        r.route
        for r in all_routes()
        if not r.route.startswith((TENANT_PREFIX, *OPERATOR_ONLY_PREFIXES))
        and r.route not in EXEMPT
    ]
    assert unknown == [], "classify these routes in test_isolation.py"
    assert any(r.route.startswith(TENANT_PREFIX) and r.params for r in all_routes())


def test_other_tenants_objects_are_404_on_every_tenant_route(
    api: ApiClient, victim_with_key: Victim
) -> None:
    victim = victim_with_key
    owner = ApiClient(victim.key)
    checked: list[str] = []
    owner_checks: list[tuple[str, str]] = []
    for route in all_routes():
        if not route.route.startswith(TENANT_PREFIX) or not route.params:
            continue
        missing = [p for p in route.params if p not in victim.fillers]
        assert missing == [], f"{route.route}: no filler for {missing}; add one to the victim"
        url = route.url(victim.fillers)
        for method in route.methods:
            response = api.request(method, url, {} if method != "get" else None)
            assert response.status_code == 404, f"{method.upper()} {url}: {response.status_code}"
            assert response.json()["error"]["message"]
            checked.append(f"{method.upper()} {route.route}")
            owner_checks.append((method, url))
    # The fillers are real: their owner does not get a 404 (deletes last, they remove objects).
    for method, url in sorted(owner_checks, key=lambda mu: mu[0] == "delete"):
        response = owner.request(method, url, {} if method != "get" else None)
        assert response.status_code != 404, f"owner {method.upper()} {url} is 404"
    assert "GET v1/files/<str:file_id>/content" in checked
    assert "POST v1/fine_tuning/jobs/<str:fine_tuning_job_id>/cancel" in checked
    assert "POST v1/uploads/<str:upload_id>/complete" in checked
    assert "DELETE v1/models/<str:model>" in checked
    assert "GET v1/models/<str:model>/content" in checked
    content = "v1/fine_tuning/jobs/<str:fine_tuning_job_id>/checkpoints/<str:checkpoint_id>/content"
    assert f"GET {content}" in checked


def test_tenant_collections_hide_and_refuse_other_tenants_objects(
    api: ApiClient, victim_with_key: Victim
) -> None:
    victim = victim_with_key
    secrets = [victim.file.id, victim.job.id, str(victim.fillers["model"])]
    jobs_before = FinetuneJob.objects.count()
    for route in all_routes():
        if not route.route.startswith(TENANT_PREFIX) or route.params:
            continue
        url = route.url({})
        query = COLLECTION_QUERIES.get(route.route, "").format(day_ago=int(time.time()) - 86400)
        for method in route.methods:
            if method == "get":
                response = api.get(url + query)
                assert response.status_code == 200, url
                leaked = [s for s in secrets if s in response.content.decode()]
                assert leaked == [], f"GET {url} shows another tenant's {leaked}"
            else:
                body = {
                    "model": victim.fillers["model"],
                    "training_file": victim.file.id,
                    "purpose": "fine-tune",
                }
                response = api.request(method, url, body)
                assert 400 <= response.status_code < 500, f"{method.upper()} {url}"
                # Indistinguishable from naming objects that do not exist at all.
                made_up = {**body, "model": "ft:tiny:x::ftjob-none", "training_file": "file-none"}
                baseline = api.request(method, url, made_up)
                error, expected = response.json()["error"], baseline.json()["error"]
                assert (response.status_code, error["param"], error["code"]) == (
                    baseline.status_code,
                    expected["param"],
                    expected["code"],
                ), f"{method.upper()} {url}"
    assert FinetuneJob.objects.count() == jobs_before
    # The victim's usage is real: its owner sees it where the other tenant saw nothing.
    usage_route = "v1/organization/usage/completions"
    query = COLLECTION_QUERIES[usage_route].format(day_ago=int(time.time()) - 86400)
    owned = ApiClient(victim.key).get(f"/{usage_route}{query}")
    assert str(victim.fillers["model"]) in owned.content.decode()


def test_operator_routes_refuse_tenant_keys(api: ApiClient, victim_with_key: Victim) -> None:
    refused = 0
    for route in all_routes():
        if not route.route.startswith(OPERATOR_ONLY_PREFIXES) or route.route in EXEMPT:
            continue
        missing = [p for p in route.params if p not in victim_with_key.fillers]
        assert missing == [], f"{route.route}: no filler for {missing}"
        url = route.url(victim_with_key.fillers)
        for method in route.methods:
            response = api.request(method, url, {} if method != "get" else None)
            assert response.status_code in OPERATOR_ONLY_REFUSALS, f"{method.upper()} {url}"
            refused += 1
    assert refused > 0


def test_revoked_tenant_users_key_cannot_see_its_own_objects(victim_with_key: Victim) -> None:
    """Fail closed: a key whose tenant user is deactivated resolves no tenant."""
    user = victim_with_key.tenant.users.get()
    user.is_active = False
    user.save()
    key = api_key_issue_for_tenant(tenant=victim_with_key.tenant).key
    assert ApiClient(key).get(f"/v1/files/{victim_with_key.file.id}").status_code == 401
