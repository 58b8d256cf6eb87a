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


@pytest.mark.parametrize(
    ("lora", "needle"),
    [
        ({"target_modules": ["c_attn"]}, "c_attn"),  # a GPT-2 name, not a Llama/Qwen2 module
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
        ({"target_modules": ["q_proj", "q_proj"]}, "duplicates"),
        ({"target_modules": ["all-linear", "q_proj"]}, "all-linear"),
        ({"rank": 65}, "lora.rank"),
        ({"rank": 1.5}, "lora.rank"),
        ({"rank": True}, "lora.rank"),
        ({"alpha": 0}, "lora.alpha"),
        ({"alpha": 4096.5}, "lora.alpha"),
        ({"alpha": "32"}, "lora.alpha"),
    ],
)
def test_lora_out_of_the_architectures_bounds_is_refused(
    api: ApiClient, training_file: File, tiny: BaseModel, lora: dict[str, Any], needle: str
) -> None:
    body = {"model": "tiny", "training_file": training_file.id, "lora": lora}
    error = assert_error(api.post("/v1/fine_tuning/jobs", body), 400)
    assert error["param"] == f"lora.{next(iter(lora))}"
    assert needle in error["message"]
    assert FinetuneJob.objects.count() == 0


def test_target_modules_are_the_architectures_projections(
    api: ApiClient, training_file: File, tiny: BaseModel
) -> None:
    assert tiny.architecture == "llama"
    error = assert_error(
        api.post(
            "/v1/fine_tuning/jobs",
            {"model": "tiny", "training_file": training_file.id, "lora": {"target_modules": ["x"]}},
        ),
        400,
        param="lora.target_modules",
    )
    assert "down_proj" in error["message"]  # the message lists what the architecture has
    for modules in (["all-linear"], ["gate_proj", "up_proj", "down_proj"], ["o_proj"]):
        body = {"model": "tiny", "training_file": training_file.id}
        created = api.post("/v1/fine_tuning/jobs", {**body, "lora": {"target_modules": modules}})
        assert created.status_code == 200, created.content
        assert created.json()["lora"]["target_modules"] == modules


def test_every_architecture_names_its_lora_modules() -> None:
    from gpu_runtime.contract.hparams import LORA_MODULES_BY_ARCHITECTURE
    from gpu_runtime.contract.model_config import ARCHITECTURES

    assert set(LORA_MODULES_BY_ARCHITECTURE) == set(ARCHITECTURES)
    with pytest.raises(HarliError) as caught:
        parse_lora({"target_modules": ["q_proj"]}, architecture="gpt2")
    assert caught.value.param == "lora.target_modules"
