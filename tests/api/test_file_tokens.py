"""A job's files are tokenized at creation with the base model's training tokenizer, by the
hosts' rule and limit: a file a host would refuse is refused with a 400 naming lines and token
counts, before any row is written; the tokenizer comes from the checkpoint directory, a host's
published copy, or (the `tiny` preset) the runtime's own, and counts equal a host's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pytest_django.fixtures import Settings as SettingsWrapper

from api.base_model_tokenizers import TOKENIZERS
from api.models import BaseModel, File, FinetuneJob, JobEvent, Tenant
from api.services.files import UploadSource, file_create
from api.services.fleet import base_model_register
from api.storage import get_storage
from gpu_runtime.contract.tiny_tokenizer import build_tiny_tokenizer
from gpu_runtime.contract.tokenizer import load_training_tokenizer
from gpu_runtime.contract.training_data import tokenize_training_lines
from tests.api.conftest import ApiClient, assert_error, jsonl

SHORT_CHAT = {
    "messages": [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]
}
SHORT_PROMPT = {"prompt": "Q: hello", "completion": " A: world"}


def _long_chat(words: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": "word " * words},
            {"role": "assistant", "content": "Done."},
        ]
    }


def _long_prompt(words: int) -> dict[str, Any]:
    return {"prompt": "word " * words, "completion": " end"}


@pytest.fixture(autouse=True)
def fresh_tokenizers() -> Any:
    TOKENIZERS.clear()
    yield
    TOKENIZERS.clear()


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(directory)
    return directory


def _upload(tenant: Tenant, data: bytes) -> File:
    return file_create(
        tenant=tenant, purpose="fine-tune", upload=UploadSource.from_bytes(filename="t", data=data)
    )


def _token_counts(directory: Path, data: bytes) -> list[int]:
    """What a host counts: the hosts' loader over the tokenizer files, the hosts' rule."""
    lines = data.splitlines()
    tokenized = tokenize_training_lines(lines, load_training_tokenizer(directory), 10**6, "f")
    return [example.num_tokens for example in tokenized.examples]


def _create(api: ApiClient, file: File, **extra: Any) -> Any:
    return api.post("/v1/fine_tuning/jobs", {"model": "tiny", "training_file": file.id, **extra})


@pytest.mark.parametrize("long", [_long_chat, _long_prompt], ids=["chat", "prompt_completion"])
def test_a_too_long_example_refuses_the_job_with_lines_and_counts_and_writes_nothing(
    api: ApiClient, tenant: Tenant, tiny: BaseModel, tiny_tokenizer_dir: Path, long: Any
) -> None:
    short = SHORT_CHAT if long is _long_chat else SHORT_PROMPT
    data = jsonl(short, long(600), short) + b"\n" + jsonl(long(700))
    file = _upload(tenant, data)
    counts = _token_counts(tiny_tokenizer_dir, data)
    assert counts[1] > 512 and counts[3] > 512 and max(counts[0], counts[2]) < 512

    error = assert_error(_create(api, file), 400, param="training_file")
    assert error["code"] == "example_too_long"
    assert error["message"].startswith(
        f"Training file {file.id}: 2 example(s) longer than the limit of 512 tokens: "
        f"line 2 ({counts[1]} tokens), line 5 ({counts[3]} tokens). The limit is the context "
        "length of base model tiny (512 tokens), at most 2048"
    )
    assert file.storage_key not in error["message"]
    assert not FinetuneJob.objects.exists() and not JobEvent.objects.exists()


def test_a_too_long_validation_example_names_the_validation_file(
    api: ApiClient, tenant: Tenant, tiny: BaseModel, training_file: File
) -> None:
    validation = _upload(tenant, jsonl(SHORT_CHAT, _long_chat(600)))
    error = assert_error(
        _create(api, training_file, validation_file=validation.id), 400, param="validation_file"
    )
    assert error["code"] == "example_too_long"
    assert error["message"].startswith(f"Validation file {validation.id}: 1 example(s) ")
    assert "line 2 (" in error["message"]
    assert not FinetuneJob.objects.exists()


def test_the_error_lists_the_first_ten_and_counts_the_rest(
    api: ApiClient, tenant: Tenant, tiny: BaseModel
) -> None:
    file = _upload(tenant, jsonl(*[_long_prompt(600 + i) for i in range(13)]))
    message = assert_error(_create(api, file), 400, param="training_file")["message"]
    assert "13 example(s) longer" in message
    assert "line 10 (" in message and "line 11 (" not in message
    assert "; and 3 more." in message


def test_a_line_the_hosts_refuse_is_refused_at_creation(
    api: ApiClient, tenant: Tenant, tiny: BaseModel
) -> None:
    """The upload check knows the shape; the hosts' rule also knows `weight`."""
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                                                          "weight": 2}]}  # fmt: skip
    file = _upload(tenant, jsonl(SHORT_CHAT, bad))
    error = assert_error(_create(api, file), 400, param="training_file")
    assert error["code"] == "invalid_file_format"
    assert error["message"] == (
        f"Training file {file.id}, line 2: messages[1].weight must be 0 or 1"
    )
    assert not FinetuneJob.objects.exists()


def test_examples_at_the_limit_are_accepted(
    api: ApiClient, tenant: Tenant, tiny_tokenizer_dir: Path
) -> None:
    data = jsonl(_long_prompt(600))
    (count,) = _token_counts(tiny_tokenizer_dir, data)
    base_model_register(name="tiny", preset="tiny", context_length=count)
    file = _upload(tenant, data)
    assert _create(api, file).status_code == 200
    BaseModel.objects.filter(name="tiny").update(context_length=count - 1)
    assert_error(_create(api, file), 400, param="training_file")


def test_control_plane_counts_equal_the_hosts(
    tenant: Tenant, tiny: BaseModel, tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The same file through the control plane's check and through a host's job setup (its
    training tokenizer published from a tiny model directory, and the engine's own tokenizer)."""
    from transformers import AutoTokenizer

    from api.base_model_tokenizers import base_model_tokenizer
    from api.file_tokens import file_tokenize
    from gpu_runtime.agent.job_run import read_examples
    from gpu_runtime.agent.tokenizers import host_training_tokenizer

    data = jsonl(SHORT_CHAT, _long_chat(40), SHORT_CHAT) + b"\n"
    prompts = jsonl(SHORT_PROMPT, _long_prompt(50), {"prompt": "", "completion": "x y"})
    for content in (data, prompts):
        file = _upload(tenant, content)
        control = file_tokenize(
            file=file,
            role="training",
            tokenizer=base_model_tokenizer(base_model=tiny),
            base_model=tiny,
        )
        storage = get_storage()
        host_tokenizer = host_training_tokenizer(storage, "tiny", tiny_tokenizer_dir)
        assert host_tokenizer is not None
        host = read_examples(storage, file.storage_key, file.id, host_tokenizer, 512)
        engine = read_examples(
            storage,
            file.storage_key,
            file.id,
            AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)),
            512,
        )
        assert control.examples == host == engine
        assert control.line_numbers == (1, 2, 3)


def test_the_tiny_preset_as_run_sh_registers_it_needs_no_host(
    db: None, settings: SettingsWrapper, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`scripts/run.sh` seeds the demo (`seed_demo`: the `tiny` preset) and starts one host; a
    job on the demo file is accepted before that host has published anything."""
    from django.core.management import call_command

    settings.DATA_DIR = tmp_path
    call_command("seed_demo", "--url", "http://127.0.0.1:8000")
    key = next(
        line.split()[-1] for line in capsys.readouterr().out.splitlines() if "API key:" in line
    )
    assert not get_storage().list_keys("tokenizers")
    api = ApiClient(key)
    uploaded = api.upload((tmp_path / "demo" / "train.jsonl").read_bytes())
    assert uploaded.status_code == 200, uploaded.content
    created = api.post(
        "/v1/fine_tuning/jobs", {"model": "tiny", "training_file": uploaded.json()["id"]}
    )
    assert created.status_code == 200, created.content
    assert created.json()["status"] == "queued"


def test_tokenizer_from_the_checkpoint_then_a_host_or_a_409(
    api: ApiClient, tenant: Tenant, tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    from gpu_runtime.contract.published_tokenizer import publish_tokenizer

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    base_model_register(
        name="tiny", checkpoint_dir=str(model_dir), architecture="llama", context_length=64
    )
    file = _upload(tenant, jsonl(SHORT_CHAT, _long_chat(80)))

    error = assert_error(_create(api, file), 409, param="model")
    assert error["code"] == "tokenizer_unavailable"
    assert error["message"].startswith("No host has published the tokenizer of base model tiny")
    assert not FinetuneJob.objects.exists()

    publish_tokenizer(get_storage(), "tiny", tiny_tokenizer_dir)  # a host loaded the model
    refused = assert_error(_create(api, file), 400, param="training_file")
    assert "limit of 64 tokens: line 2 (" in refused["message"]

    for path in tiny_tokenizer_dir.iterdir():  # now the control plane can read the checkpoint
        (model_dir / path.name).write_bytes(path.read_bytes())
    get_storage().delete("tokenizers/tiny/.complete")
    assert "limit of 64 tokens: line 2 (" in assert_error(_create(api, file), 400)["message"]
    short = _upload(tenant, jsonl(SHORT_CHAT))
    assert _create(api, short).status_code == 200


def test_a_host_publishes_its_tokenizer_once_per_digest(tiny_tokenizer_dir: Path) -> None:
    from gpu_runtime.contract.published_tokenizer import publish_tokenizer, published_digest

    storage = get_storage()
    digest = publish_tokenizer(storage, "tiny", tiny_tokenizer_dir)
    assert published_digest(storage, "tiny") == digest
    assert sorted(k.rsplit("/", 1)[1] for k in storage.list_keys("tokenizers/tiny")) == [
        ".complete",
        "chat_template.jinja",
        "manifest.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    marker = storage.path("tokenizers/tiny/.complete")  # type: ignore[attr-defined]
    before = marker.stat().st_mtime_ns
    assert publish_tokenizer(storage, "tiny", tiny_tokenizer_dir) == digest  # unchanged: no write
    assert marker.stat().st_mtime_ns == before
    assert json.loads(b"".join(storage.read_chunks("tokenizers/tiny/manifest.json"))) == {
        "base_model": "tiny",
        "digest": digest,
    }
