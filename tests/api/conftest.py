"""Fixtures for the control-plane tests: tenants with API keys, base models, clients."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from pytest_django.fixtures import Settings as SettingsWrapper

from api.models import BaseModel, File, Tenant, User
from api.services.apikeys import api_key_issue, api_key_issue_for_tenant
from api.services.files import UploadSource, file_create
from api.services.fleet import base_model_register
from api.services.tenants import operator_create, tenant_create

CHAT_LINE = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]
}


def jsonl(*records: Any) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


VALID_JSONL = jsonl(CHAT_LINE, CHAT_LINE, CHAT_LINE)


class ApiClient:
    """A Django test client that sends `Authorization: Bearer <key>` and decodes JSON."""

    def __init__(self, key: str | None) -> None:
        self.client = Client()
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def request(self, method: str, path: str, body: Any = None, **extra: Any) -> Any:
        call: Callable[..., Any] = getattr(self.client, method.lower())
        if body is not None and "content_type" not in extra and method.lower() != "get":
            extra["content_type"] = "application/json"
            body = json.dumps(body)
        if body is None:
            return call(path, headers=self.headers, **extra)
        return call(path, body, headers=self.headers, **extra)

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("get", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Any:
        return self.request("post", path, body, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("delete", path, **kw)

    def upload(
        self, data: bytes, *, filename: str = "train.jsonl", purpose: str = "fine-tune"
    ) -> Any:
        from django.core.files.uploadedfile import SimpleUploadedFile

        return self.client.post(
            "/v1/files",
            {"file": SimpleUploadedFile(filename, data), "purpose": purpose},
            headers=self.headers,
        )


@pytest.fixture(autouse=True)
def storage_dir(settings: SettingsWrapper, tmp_path: Path) -> Path:
    root = tmp_path / "storage"
    settings.HARLI_STORAGE_DIR = root
    return root


@pytest.fixture
def tiny(db: None) -> BaseModel:
    return base_model_register(name="tiny", preset="tiny")


@pytest.fixture
def tenant(db: None) -> Tenant:
    return tenant_create(name="acme")


@pytest.fixture
def other_tenant(db: None) -> Tenant:
    return tenant_create(name="globex")


@pytest.fixture
def tenant_key(tenant: Tenant) -> str:
    return api_key_issue_for_tenant(tenant=tenant).key


@pytest.fixture
def other_key(other_tenant: Tenant) -> str:
    return api_key_issue_for_tenant(tenant=other_tenant).key


@pytest.fixture
def api(tenant_key: str) -> ApiClient:
    return ApiClient(tenant_key)


@pytest.fixture
def operator(db: None) -> User:
    return operator_create(username="ops", password="s3cret-pass")


@pytest.fixture
def operator_key(operator: User) -> str:
    return api_key_issue(user=operator).key


@pytest.fixture
def ops(operator_key: str) -> ApiClient:
    return ApiClient(operator_key)


@pytest.fixture
def training_file(tenant: Tenant) -> File:
    return file_create(
        tenant=tenant,
        purpose="fine-tune",
        upload=UploadSource.from_bytes(filename="train.jsonl", data=VALID_JSONL),
    )


def assert_error(response: Any, status: int, *, param: str | None = None) -> dict[str, Any]:
    """The response is the uniform error body with `status`; returns its `error` object."""
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return dict(error)
