"""Adapters on a host at run time: the operator's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` on the agent's server (served at once, from a private copy, named by
the next heartbeat; refused without the admin token), the settings that open them, and the
`adapter_load_failed` report of a `load_adapter` command the host cannot apply."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from gpu_runtime.agent.cli import parse_args
from gpu_runtime.agent.config import AgentConfigError
from gpu_runtime.agent.host_auth import host_auth
from gpu_runtime.agent.operator_adapters import OperatorAdapters
from gpu_runtime.contract.protocol import check_command, check_report
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.finetune.checkpoint import ADAPTER_CONFIG
from gpu_runtime.server import create_app
from gpu_runtime.server.adapter_admin import AdapterAdmin
from tests.gpu_runtime.agent.conftest import Host, Reports
from tests.gpu_runtime.agent.host_server import agent_config, grant, random_adapter
from tests.gpu_runtime.server.serving import serve_in_thread

ADMIN = "host-admin-token"
NAME = "ops_poet"


def _load(root: str, body: dict[str, str], token: str | None = ADMIN) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{root}/v1/load_lora_adapter", json=body, headers=headers, timeout=60)


def _unload(root: str, name: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {ADMIN}"}
    return httpx.post(
        f"{root}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60
    )


def test_operator_loads_and_unloads_an_adapter_on_a_running_host(
    host: Host, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapters = tmp_path / "operator"
    random_adapter(tiny_model_dir, adapters / "poet", seed=5)
    (adapters / "poet" / "README.md").write_text("not copied: only the PEFT files are")
    random_adapter(tiny_model_dir, adapters / "broken", seed=6)
    config_path = adapters / "broken" / ADAPTER_CONFIG
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"r": "many"}))
    admin = AdapterAdmin(ADMIN, (adapters,), OperatorAdapters(host.runtime))
    app = create_app(host.loop, "tiny", host_auth(agent_config(tmp_path)), adapter_admin=admin)
    copies = tmp_path / "work" / "adapters"
    with serve_in_thread(app) as url:
        root = url.removesuffix("/v1")
        assert _load(root, {"lora_name": NAME, "lora_path": "poet"}, token=None).status_code == 401
        loaded = _load(root, {"lora_name": NAME, "lora_path": "poet"})
        assert loaded.status_code == 200, loaded.text
        assert host.runtime.status().adapters == [NAME]  # the next heartbeat names it
        assert sorted(p.name for p in (copies / NAME).iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors",
        ]  # fmt: skip
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60,
                               default_headers=grant("tiny", NAME))  # fmt: skip
        assert [m.id for m in client.models.list().data] == ["tiny", NAME]

        def greedy(model: str) -> str:
            out = client.completions.create(model=model, prompt="Once upon", max_tokens=8,
                                            temperature=0)  # fmt: skip
            return out.choices[0].text

        assert greedy(NAME) != greedy("tiny")  # served with its weights, no restart
        again = _load(root, {"lora_name": NAME, "lora_path": "poet"})
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        clash = _load(root, {"lora_name": "ops:poet", "lora_path": "poet"})  # copy: ops_poet
        assert clash.status_code == 400 and "share the host's copy" in clash.text
        assert (copies / NAME / "adapter_config.json").is_file()  # the served copy is kept
        broken = _load(root, {"lora_name": "ops-broken", "lora_path": "broken"})
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "lora_path"
        assert not (copies / "ops-broken").exists()  # nothing left of the failed load
        assert host.runtime.status().adapters == [NAME]
        assert _unload(root, NAME).status_code == 200
        assert host.runtime.status().adapters == []
        assert not (copies / NAME).exists()
        with pytest.raises(openai.NotFoundError):
            greedy(NAME)
        assert _unload(root, NAME).status_code == 404


def _load_command(name: str, key: str) -> dict[str, object]:
    return check_command(
        {"command": "load_adapter", "command_id": "c1", "name": name, "storage_key": key}
    )


def test_a_load_the_host_cannot_apply_is_reported(
    host: Host, reports: Reports, tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path
) -> None:
    host.command(_load_command("ft:tiny:acme:x:ftjob-9", "adapters/ftjob-9"))
    failed = check_report(reports.wait_for("adapter_load_failed"))
    assert failed["name"] == "ft:tiny:acme:x:ftjob-9"
    assert failed["storage_key"] == "adapters/ftjob-9"
    assert "no complete tree" in failed["message"]
    bad = random_adapter(tiny_model_dir, tmp_path / "bad", seed=2)
    (bad / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "PROMPT_TUNING"}))
    storage.put_tree("adapters/ftjob-10", bad)
    host.command(_load_command("ft:tiny:acme:x:ftjob-10", "adapters/ftjob-10"))
    failed = reports.wait_for("adapter_load_failed")
    assert failed["name"] == "ft:tiny:acme:x:ftjob-10" and "only LORA adapters" in failed["message"]
    assert host.runtime.status().adapters == []
    assert not (tmp_path / "work" / "adapters" / "ft_tiny_acme_x_ftjob-10").exists()
    good = random_adapter(tiny_model_dir, tmp_path / "good", seed=3)
    storage.put_tree("adapters/ftjob-11", good)
    host.command(_load_command("ft:tiny:acme:x:ftjob-11", "adapters/ftjob-11"))
    assert host.runtime.status().adapters == ["ft:tiny:acme:x:ftjob-11"]
    assert reports.kinds().count("adapter_load_failed") == 2  # the good load reports nothing


def test_the_admin_settings_go_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--host", "h1", "--broker", "redis://127.0.0.1:6379/0"]
    config = parse_args(base)
    assert config.admin_token is None and config.adapter_roots == ()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adapters").mkdir()
    monkeypatch.setenv("HARLI_HOST_ADMIN_TOKEN", ADMIN)
    config = parse_args([*base, "--adapter-root", "adapters"])
    assert config.admin_token == ADMIN and config.adapter_roots == (tmp_path / "adapters",)
    assert ADMIN not in repr(config)
    refusals = [([], "token set, roots []"),
                (["--adapter-root", "missing"], "is not an absolute directory")]  # fmt: skip
    for extra, message in refusals:
        with pytest.raises(SystemExit):
            parse_args([*base, *extra])
        assert message in capsys.readouterr().err
    monkeypatch.delenv("HARLI_HOST_ADMIN_TOKEN")
    with pytest.raises(SystemExit):
        parse_args([*base, "--adapter-root", "adapters"])
    assert "token unset" in capsys.readouterr().err
    with pytest.raises(AgentConfigError, match="go together"):
        agent_config(tmp_path, admin_token=ADMIN)
