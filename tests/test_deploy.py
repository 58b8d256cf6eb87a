"""`deploy/`: the systemd units start commands that exist, with options their programs accept,
and every variable a unit or production settings read is in an environment file example."""

from __future__ import annotations

import ast
import configparser
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
from django.core.management import get_commands

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
UNITS = DEPLOY / "systemd"
VENV_BIN = "/opt/harli/.venv/bin/"
INSTANCE = "gpu-01"
"""The host name a template unit's `%i` stands for here."""
CONTROL_PLANE_UNITS = ["harli-web.service", "harli-worker.service", "harli-beat.service"]
AGENT_UNIT = "harli-agent@.service"


def read_env_example(name: str) -> dict[str, str]:
    """The KEY=VALUE lines of an environment file example (comments and blanks skipped)."""
    values: dict[str, str] = {}
    for line in (DEPLOY / name).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", key), f"{name}: {line!r}"
            assert key not in values, f"{name}: {key} set twice"
            values[key] = value
    return values


def read_unit(name: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string((UNITS / name).read_text())
    return unit


def command(unit: configparser.ConfigParser, key: str, env: dict[str, str]) -> list[str]:
    """A unit's command line as systemd runs it: lines joined, `%i` and `%%` resolved,
    `${VAR}` taken from `env` (a variable missing there fails the test)."""
    text = unit["Service"][key].replace("\\\n", " ")
    missing = sorted(set(re.findall(r"\$\{(\w+)\}", text)) - set(env))
    assert not missing, f"{key} uses variables no environment file example sets: {missing}"
    text = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], text)
    text = re.sub(r"%(.)", lambda m: {"i": INSTANCE, "%": "%"}[m.group(1)], text)
    return shlex.split(text)


def program(argv: list[str]) -> str:
    """The venv program a command runs, which the lock file must install."""
    assert argv[0].startswith(VENV_BIN), argv[0]
    name = argv[0].removeprefix(VENV_BIN)
    assert Path(sys.executable).with_name(name).exists(), f"{name} is not installed in the venv"
    return name


def defines(module: str, name: str) -> bool:
    """Whether `module` (found, not imported) assigns `name` at its top level."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"no module {module}"
    tree = ast.parse(Path(spec.origin).read_text())
    return any(
        isinstance(node, ast.Assign | ast.AnnAssign)
        and any(
            isinstance(target, ast.Name) and target.id == name
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
        for node in tree.body
    )


def check_manage_py(argv: list[str]) -> None:
    assert program(argv) == "python" and argv[1] == "manage.py"
    assert argv[2] in get_commands(), f"manage.py has no command {argv[2]}"


def test_the_units_are_web_worker_beat_and_the_agent_template() -> None:
    assert sorted(path.name for path in UNITS.iterdir()) == sorted(
        [*CONTROL_PLANE_UNITS, AGENT_UNIT]
    )


@pytest.mark.parametrize("name", [*CONTROL_PLANE_UNITS, AGENT_UNIT])
def test_every_unit_runs_as_harli_from_the_checkout_and_restarts(name: str) -> None:
    service = read_unit(name)["Service"]
    assert service["User"] == "harli" and service["WorkingDirectory"] == "/opt/harli"
    assert service["Restart"] == "always" and service["KillMode"] == "mixed"
    assert read_unit(name)["Install"]["WantedBy"] == "multi-user.target"


def test_web_runs_uvicorn_on_the_asgi_app_with_options_uvicorn_accepts() -> None:
    from uvicorn.main import main as uvicorn_command

    unit = read_unit("harli-web.service")
    env = read_env_example("harli.env.example")
    assert unit["Service"]["EnvironmentFile"] == "/etc/harli/harli.env"
    check_manage_py(command(unit, "ExecStartPre", env))
    argv = command(unit, "ExecStart", env)
    assert program(argv) == "uvicorn"
    params = uvicorn_command.make_context("uvicorn", argv[1:]).params
    module, _, attribute = params["app"].partition(":")
    assert (module, attribute) == ("config.asgi", "application")
    assert defines(module, attribute)
    assert params["workers"] == int(env["HARLI_WEB_WORKERS"])
    assert params["limit_concurrency"] == int(env["HARLI_WEB_LIMIT_CONCURRENCY"])
    assert params["timeout_keep_alive"] == int(env["HARLI_WEB_KEEP_ALIVE_S"])
    assert params["proxy_headers"] is False


@pytest.mark.parametrize(
    ("name", "subcommand"), [("harli-worker.service", "worker"), ("harli-beat.service", "beat")]
)
def test_worker_and_beat_run_the_celery_app_with_options_celery_accepts(
    name: str, subcommand: str
) -> None:
    from celery.bin.base import CLIContext
    from celery.bin.celery import celery

    from config.celery import app

    unit = read_unit(name)
    assert unit["Service"]["EnvironmentFile"] == "/etc/harli/harli.env"
    argv = command(unit, "ExecStart", read_env_example("harli.env.example"))
    assert program(argv) == "celery"
    at = argv.index(subcommand)
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    group = celery.make_context("celery", argv[1 : at + 1], obj=obj)
    assert group.params["app"] == "config" and defines("config.celery", "app")
    params = celery.commands[subcommand].make_context(subcommand, argv[at + 1 :], parent=group)
    if subcommand == "worker":
        assert params.params["queues"] == ["control"]
        # systemd turns %%h into %h, which Celery expands to this machine's name.
        assert argv[argv.index("--hostname") + 1] == "harli-worker@%h"


def test_the_agent_template_runs_the_agent_with_options_it_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpu_runtime.agent.cli import parse_args

    unit = read_unit(AGENT_UNIT)
    assert unit["Service"]["EnvironmentFile"] == "-/etc/harli/agent-%i.env"  # the last one
    assert "EnvironmentFile=/etc/harli/agent.env" in (UNITS / AGENT_UNIT).read_text()
    env = read_env_example("harli-agent.env.example")
    argv = command(unit, "ExecStart", env)
    assert program(argv) == "python" and argv[1:3] == ["-m", "gpu_runtime.agent"]
    assert importlib.util.find_spec("gpu_runtime.agent.__main__") is not None
    # The agent reads the rest from its environment. The example's model directory and GPU are
    # a real host's: here the built-in tiny model on the CPU stands in for them.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HARLI_MODEL_DIR", "")
    monkeypatch.setenv("HARLI_DEVICE", "cpu")
    monkeypatch.delenv("HARLI_OUTBOX_DIR", raising=False)  # the example leaves the default
    key_file = tmp_path / "host-key"
    key_file.write_text("ab" * 32)
    args = argv[3:]
    args[args.index("--host-key-file") + 1] = str(key_file)
    config = parse_args(args)
    assert config.host == INSTANCE and config.host_key == "ab" * 32
    assert f"{config.server_host}:{config.server_port}" == env["HARLI_AGENT_LISTEN"]
    assert config.broker_url == env["CELERY_BROKER_URL"]
    assert config.storage == env["HARLI_STORAGE_DIR"]
    assert config.work_dir == Path(f"/var/lib/harli/agents/{INSTANCE}")
    # the durable outbox: on the host's own disk, under the unit's StateDirectory
    assert config.outbox_path() == Path(f"/var/lib/harli/agents/{INSTANCE}/outbox")
    assert unit["Service"]["StateDirectory"] == "harli/agents/%i"


def test_the_environment_example_sets_every_variable_production_settings_read() -> None:
    env = read_env_example("harli.env.example")
    required = {"DJANGO_SECRET_KEY", "DATABASE_URL", "HARLI_GATEWAY_SECRET", "CELERY_BROKER_URL"}
    production = (ROOT / "config" / "settings" / "production.py").read_text()
    read_there = set(re.findall(r'env_\w+\(\s*"(\w+)"', production))
    assert read_there  # the pattern still finds them
    assert sorted((required | read_there) - set(env)) == []
    assert env["DJANGO_SETTINGS_MODULE"] == "config.settings.production"
