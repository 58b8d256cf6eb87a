"""Non-finite and out-of-range training settings are refused at validation with a 400 naming
the field; nothing is written and the job lists keep answering."""

from __future__ import annotations

from typing import Any

import pytest

from api.errors import HarliError
from api.hyperparameters import parse_lora
from api.models import BaseModel, File, FinetuneJob
from tests.api.conftest import ApiClient, assert_error

BIG = "1e309"  # JSON reads it as infinity


@pytest.mark.parametrize(
    ("fragment", "param"),
    [
        (f'"lora": {{"alpha": {BIG}}}', "lora.alpha"),
        (f'"lora": {{"alpha": -{BIG}}}', "lora.alpha"),
        ('"lora": {"alpha": 1e300}', "lora.alpha"),
        (f'"lora": {{"dropout": {BIG}}}', "lora.dropout"),
        ('"hyperparameters": {"learning_rate_multiplier": 1e400}', "learning_rate_multiplier"),
        ('"hyperparameters": {"learning_rate_multiplier": -1e400}', "learning_rate_multiplier"),
        (f'"hyperparameters": {{"n_epochs": {BIG}}}', "n_epochs"),
        ('"hyperparameters": {"batch_size": %s}' % ("9" * 400), "batch_size"),
        (
            f'"method": {{"type": "dpo", "dpo": {{"hyperparameters": {{"beta": {BIG}}}}}}}',
            "beta",
        ),
    ],
)
def test_non_finite_or_huge_numbers_are_refused_and_lists_keep_working(
    api: ApiClient,
    ops: ApiClient,
    training_file: File,
    tiny: BaseModel,
    fragment: str,
    param: str,
) -> None:
    body = f'{{"model": "tiny", "training_file": "{training_file.id}", {fragment}}}'
    response = api.post("/v1/fine_tuning/jobs", body, content_type="application/json")
    error = assert_error(response, 400, param=param)
    assert param in error["message"]
    assert FinetuneJob.objects.count() == 0
    assert api.get("/v1/fine_tuning/jobs").status_code == 200
    assert ops.get("/api/ops/jobs").status_code == 200


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 10**400])
def test_parse_lora_refuses_non_finite_alpha(value: Any) -> None:
    with pytest.raises(HarliError) as caught:
        parse_lora({"alpha": value})
    assert caught.value.param == "lora.alpha"
