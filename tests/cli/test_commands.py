"""The admin CLI: each noun's subcommands, their errors, and `apikeys issue` in a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from api.models import ApiKey, BaseModel, Deployment, FinetuneJob, GpuHost, Tenant, User
from api.services.apikeys import api_key_authenticate
from api.services.files import UploadSource, file_create
from api.services.jobs import finetune_job_create
from tests.api.services.conftest import heartbeat

ROOT = Path(__file__).resolve().parents[2]
NOUNS = ["tenants", "apikeys", "basemodels", "hosts", "deployments", "jobs", "operators"]


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.mark.parametrize("noun", NOUNS)
def test_every_command_has_help(noun: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        call_command(noun, "--help")
    assert exited.value.code == 0
    assert "ACTION" in capsys.readouterr().out


@pytest.mark.django_db
def test_tenants_and_apikeys() -> None:
    assert "Created tenant acme" in run("tenants", "create", "acme")
    assert "acme" in run("tenants", "list")
    with pytest.raises(CommandError, match="already exists"):
        run("tenants", "create", "acme")
    with pytest.raises(CommandError, match="Invalid tenant name"):
        run("tenants", "create", "Not Valid")

    output = run("apikeys", "issue", "--tenant", "acme", "--name", "ci")
    key = output.strip().splitlines()[-1]
    api_key = api_key_authenticate(key=key)
    assert api_key is not None and api_key.user.tenant == Tenant.objects.get(name="acme")
    listing = run("apikeys", "list", "--tenant", "acme")
    assert api_key.prefix in listing and "active" in listing and key not in listing
    assert "Revoked" in run("apikeys", "revoke", api_key.prefix)
    assert api_key_authenticate(key=key) is None
    assert "revoked" in run("apikeys", "list")
    with pytest.raises(CommandError, match="No API key"):
        run("apikeys", "revoke", "hk-nothing")
    with pytest.raises(CommandError, match="No tenant named"):
        run("apikeys", "issue", "--tenant", "nobody")
    with pytest.raises(CommandError):
        run("apikeys", "issue")


@pytest.mark.django_db
def test_fleet_commands(tmp_path: Path) -> None:
    assert "preset tiny" in run("basemodels", "register", "tiny", "--preset", "tiny")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "max_position_embeddings": 4096})
    )
    run("basemodels", "register", "local-qwen", "--checkpoint", str(checkpoint))
    local = BaseModel.objects.get(name="local-qwen")
    assert (local.architecture, local.context_length, local.config) == ("qwen2", 4096, None)
    with pytest.raises(CommandError, match="Architecture must be a model type name"):
        run("basemodels", "register", "bare", "--checkpoint", str(tmp_path / "missing"))
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["MistralForCausalLM"],
                "model_type": "mistral",
                "max_position_embeddings": 32768,
            }
        )  # fmt: skip
    )
    run("basemodels", "register", "mistral-7b", "--checkpoint", str(mistral))
    assert BaseModel.objects.get(name="mistral-7b").architecture == "mistral"
    with pytest.raises(CommandError, match="create the deployment with --engine vllm"):
        run("deployments", "create", "m-chat", "--base-model", "mistral-7b", "--tpot-slo-ms",
            "40", "--ttft-slo-ms", "400")  # fmt: skip
    assert not Deployment.objects.exists()
    assert "engine vllm" in run("deployments", "create", "m-chat", "--base-model", "mistral-7b",
                                "--tpot-slo-ms", "40", "--ttft-slo-ms", "400",
                                "--engine", "vllm")  # fmt: skip
    Deployment.objects.filter(name="m-chat").delete()
    with pytest.raises(CommandError):
        run("basemodels", "register", "both", "--preset", "tiny", "--checkpoint", "/x")
    assert "local-qwen" in run("basemodels", "list")

    run("deployments", "create", "chat", "--base-model", "tiny", "--tpot-slo-ms", "40",
        "--ttft-slo-ms", "400")  # fmt: skip
    assert Deployment.objects.get().slo_attainment_target_pct == 99.0
    assert Deployment.objects.get().engine == "harli"
    with pytest.raises(CommandError, match="No base model"):
        run("deployments", "create", "x", "--base-model", "nope", "--tpot-slo-ms", "1",
            "--ttft-slo-ms", "1")  # fmt: skip
    with pytest.raises(CommandError, match="tpot_slo_ms"):
        run("deployments", "create", "y", "--base-model", "tiny", "--tpot-slo-ms", "0",
            "--ttft-slo-ms", "1")  # fmt: skip
    assert "chat" in run("deployments", "list")

    output = run("hosts", "register", "gpu-0", "--gpu-kind", "H200", "--gpu-memory-gb", "141",
                 "--deployment", "chat")  # fmt: skip
    assert "queue host.gpu-0" in output
    assert GpuHost.objects.get().gpu_memory_bytes == 141 * 2**30
    assert "draining" in run("hosts", "drain", "gpu-0")
    assert "gpu-0" in run("hosts", "list", "--status", "draining")
    heartbeat("gpu-0", harvestable_tokens_per_s=9000.0, harvest={"source": "predictor"},
              predictor_version="v20261130T095333Z", predictor_mape=0.032)  # fmt: skip
    listed = run("hosts", "list").splitlines()
    assert listed[0].split()[-4:] == ["PREDICTOR", "MAPE", "HARVEST", "TOK/S"]
    assert "ENGINE" in listed[0].split() and " harli " in listed[1]
    assert listed[1].split()[-4:] == ["v20261130T095333Z", "3.2%", "9000", "(predictor)"]
    heartbeat("gpu-0", engine="vllm", capabilities={"colocation": False})
    assert "vllm (no training)" in run("hosts", "list").splitlines()[1]
    with pytest.raises(CommandError, match="No host named"):
        run("hosts", "drain", "gpu-9")
    with pytest.raises(CommandError, match="must be positive"):
        run("hosts", "register", "gpu-1", "--gpu-kind", "H200", "--gpu-memory-gb", "0")


@pytest.mark.django_db
def test_tenants_limits() -> None:
    run("tenants", "create", "acme")
    assert "acme: unlimited requests/min, unlimited tokens/min" in run("tenants", "limits", "acme")
    out = run("tenants", "limits", "acme", "--rpm", "60", "--tpm", "150000")
    assert "acme: 60 requests/min, 150000 tokens/min." in out
    acme = Tenant.objects.get(name="acme")
    assert (acme.requests_per_minute, acme.tokens_per_minute) == (60, 150000)
    # An option left out keeps its value; "none" clears.
    assert "unlimited requests/min, 150000 tokens/min" in run(
        "tenants", "limits", "acme", "--rpm", "none"
    )
    assert "unlimited requests/min, 9 tokens/min" in run("tenants", "limits", "acme", "--tpm", "9")
    listed = run("tenants", "list").splitlines()
    assert listed[0].split()[:4] == ["ID", "NAME", "RPM", "TPM"]
    assert listed[1].split()[1:4] == ["acme", "unlimited", "9"]
    with pytest.raises(CommandError, match="requests_per_minute must be an integer from 1"):
        run("tenants", "limits", "acme", "--rpm", "0")
    with pytest.raises(CommandError, match="is not an integer or 'none'"):
        run("tenants", "limits", "acme", "--tpm", "many")
    with pytest.raises(CommandError, match="No tenant named 'nobody'"):
        run("tenants", "limits", "nobody", "--rpm", "5")
    acme.refresh_from_db()
    assert (acme.requests_per_minute, acme.tokens_per_minute) == (None, 9)


@pytest.mark.django_db
def test_tenants_quotas(settings: Any) -> None:
    settings.HARLI_QUOTA_QUEUED_JOBS = 40
    run("tenants", "create", "acme")
    shown = {
        line.split()[0]: line.split() for line in run("tenants", "quotas", "acme").splitlines()
    }
    assert shown["queued_jobs"][1:3] == ["40", "default"]
    out = run("tenants", "quotas", "acme", "--queued-jobs", "3", "--stored-bytes", "0")
    rows = {line.split()[0]: line.split() for line in out.splitlines()}
    assert rows["queued_jobs"][1:5] == ["3", "tenant", "0", "3"]
    assert rows["stored_bytes"][1:3] == ["0", "tenant"]
    out = run("tenants", "quotas", "acme", "--queued-jobs", "default")
    rows = {line.split()[0]: line.split() for line in out.splitlines()}
    assert rows["queued_jobs"][1:3] == ["40", "default"] and rows["stored_bytes"][1] == "0"
    with pytest.raises(CommandError, match="quotas.running_jobs must be an integer from 0"):
        run("tenants", "quotas", "acme", "--running-jobs", "-1")
    with pytest.raises(CommandError, match="is not an integer or 'default'"):
        run("tenants", "quotas", "acme", "--running-jobs", "lots")


@pytest.mark.django_db
def test_jobs_and_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    run("tenants", "create", "acme")
    run("basemodels", "register", "tiny", "--preset", "tiny")
    line = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    file = file_create(
        tenant=Tenant.objects.get(),
        purpose="fine-tune",
        upload=UploadSource.from_bytes(filename="t.jsonl", data=json.dumps(line).encode()),
    )
    job = finetune_job_create(tenant=Tenant.objects.get(), model="tiny", training_file=file.id)
    assert job.id in run("jobs", "list", "--tenant", "acme", "--status", "queued")
    assert "cancelled" in run("jobs", "cancel", job.id)
    assert FinetuneJob.objects.get().status == "cancelled"
    with pytest.raises(CommandError, match="cannot become cancelled"):
        run("jobs", "cancel", job.id)
    with pytest.raises(CommandError, match="No such fine-tuning job"):
        run("jobs", "cancel", "ftjob-nope")

    monkeypatch.delenv("HARLI_OPERATOR_PASSWORD", raising=False)
    with pytest.raises(CommandError, match="HARLI_OPERATOR_PASSWORD"):
        run("operators", "create", "alice", "--no-input")
    monkeypatch.setenv("HARLI_OPERATOR_PASSWORD", "pw-123456")
    assert "Created operator alice" in run("operators", "create", "alice", "--no-input")
    alice = User.objects.get(username="alice")
    assert alice.is_operator and alice.check_password("pw-123456")
    with pytest.raises(CommandError, match="already exists"):
        run("operators", "create", "alice", "--no-input")
    with pytest.raises(CommandError, match="must be non-empty and not start with"):
        run("operators", "create", "tenant.acme", "--no-input")
    key = run("apikeys", "issue", "--operator", "alice").strip().splitlines()[-1]
    assert ApiKey.objects.get(prefix=key[:11]).user == alice


@pytest.mark.django_db(transaction=True)
def test_apikeys_issue_in_a_subprocess_prints_the_key_last() -> None:
    """The real `python manage.py` entry point, on the test database."""
    from django.db import connection

    from config.database import database_url

    Tenant.objects.all().delete()
    call_command("tenants", "create", "acme", stdout=StringIO())
    db = connection.settings_dict
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": database_url(db),
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "apikeys", "issue", "--tenant", "acme"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) >= 2 and lines[-1].startswith("hk-")
    api_key = api_key_authenticate(key=lines[-1])
    assert api_key is not None and api_key.user.tenant is not None
    assert api_key.user.tenant.name == "acme"

    failing = subprocess.run(
        [sys.executable, "manage.py", "apikeys", "issue", "--tenant", "nobody"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert failing.returncode == 1
    assert "No tenant named 'nobody'" in failing.stderr


@pytest.mark.django_db
def test_seed_demo_is_idempotent_and_prints_working_credentials(
    monkeypatch: pytest.MonkeyPatch, settings: object, tmp_path: Path
) -> None:
    settings.DATA_DIR = tmp_path  # type: ignore[attr-defined]
    monkeypatch.delenv("HARLI_OPERATOR_PASSWORD", raising=False)
    first = run("seed_demo", "--url", "http://127.0.0.1:9999")
    password = re.search(r"user admin, password (\S+)\)", first)
    assert password is not None
    assert User.objects.get(username="admin").check_password(password.group(1))
    key = re.search(r"demo tenant API key: +(hk-\w+)", first)
    assert key is not None and api_key_authenticate(key=key.group(1)) is not None
    assert re.search(r"tenant API \(OpenAI shape\): +http://127.0.0.1:9999/v1\n", first)
    assert (tmp_path / "demo" / "train.jsonl").read_text().count("\n") == 3

    monkeypatch.setenv("HARLI_OPERATOR_PASSWORD", "from-env-1")
    second = run("seed_demo")
    new_key = re.search(r"demo tenant API key: +(hk-\w+)", second)
    assert new_key is not None and new_key.group(1) != key.group(1)
    assert api_key_authenticate(key=key.group(1)) is None  # the earlier demo key is revoked
    assert User.objects.get(username="admin").check_password("from-env-1")
    assert (Tenant.objects.count(), BaseModel.objects.count(), Deployment.objects.count()) == (
        1,
        1,
        1,
    )


@pytest.mark.django_db
def test_operators_create_prompts_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter(["pw-one", "pw-two", "pw-ok", "pw-ok"])
    monkeypatch.setattr("getpass.getpass", lambda prompt="": next(answers))
    with pytest.raises(CommandError, match="differ"):
        run("operators", "create", "bob")
    assert not User.objects.filter(username="bob").exists()
    assert "Created operator bob" in run("operators", "create", "bob")
    assert User.objects.get(username="bob").check_password("pw-ok")


@pytest.mark.django_db
def test_hosts_key_prints_the_key_the_gateway_signs_that_hosts_grants_with() -> None:
    from django.conf import settings

    from gpu_runtime.contract.grants import Grant, grant_sign, grant_verify, host_key

    run("hosts", "register", "gpu-7", "--gpu-kind", "H200", "--gpu-memory-gb", "141")
    key = run("hosts", "key", "gpu-7").strip()
    assert key == host_key(settings.GATEWAY_SECRET, "gpu-7") and len(key) == 64
    assert key != host_key(settings.GATEWAY_SECRET, "gpu-8")  # each host its own
    token = grant_sign(Grant("gpu-7", "acme", ("tiny",), 2e9), key)
    assert grant_verify(token, key, host="gpu-7", now=1e9).models == ("tiny",)
    with pytest.raises(CommandError, match="gpu-9"):
        run("hosts", "key", "gpu-9")
