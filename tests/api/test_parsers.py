"""Bodies the parsers refuse with a 400 in the uniform body: too deeply nested JSON and NUL in
body strings, on /v1 and /api/ops/ alike; nothing is written."""

from __future__ import annotations

import json

from api.models import BaseModel, File, FinetuneJob
from tests.api.conftest import ApiClient, assert_error

DEEP = "[" * 10000 + "]" * 10000


def test_deeply_nested_json_is_a_400_on_both_apis(api: ApiClient, ops: ApiClient) -> None:
    assert_error(api.post("/v1/fine_tuning/jobs", DEEP, content_type="application/json"), 400)
    assert_error(api.post("/v1/uploads", DEEP, content_type="application/json"), 400)
    assert_error(ops.post("/api/ops/tenants", DEEP, content_type="application/json"), 400)


def test_nul_in_a_json_string_is_a_400(
    api: ApiClient, training_file: File, tiny: BaseModel
) -> None:
    for body in (
        {"model": "tiny\x00", "training_file": training_file.id},
        {"model": "tiny", "training_file": training_file.id, "metadata": {"k\x00": "v"}},
    ):
        response = api.post(
            "/v1/fine_tuning/jobs", json.dumps(body), content_type="application/json"
        )
        assert_error(response, 400)
    assert FinetuneJob.objects.count() == 0


def test_nul_in_a_form_field_is_a_400(api: ApiClient) -> None:
    response = api.client.post("/v1/files", {"purpose": "fine-tune\x00"}, headers=api.headers)
    assert_error(response, 400)
