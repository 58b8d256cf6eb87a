"""The control plane of one benchmark run, started as an operator starts it.

`postgres`: the production guide (README, "Production guide"; `deploy/systemd/`): uvicorn over
`config.asgi` with the production settings (the default settings module), PostgreSQL, a Redis
broker with a password, a Celery worker and beat; the sizes (`HARLI_WEB_WORKERS`, ...) from
`deploy/harli.env.example` unless given. The client plays the load balancer: it sends
`X-Forwarded-Proto: https` and `HARLI_TRUSTED_PROXY_HOPS=1` trusts it, as in the guide.

`sqlite`: the embedded default, the processes `scripts/run.sh` starts (uvicorn over
`config.asgi`, one process, local settings, SQLite, the `filesystem://` broker, a worker and
beat), without the host agent: no host is registered, so every job created stays queued.

Tenants and keys are made with `manage.py` (as an operator would), one base model (`tiny`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common.processes import group_cpu_seconds, stop_groups, wait_for
from bench.common.provenance import ROOT

ENV_EXAMPLE = ROOT / "deploy" / "harli.env.example"
BASE_MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env_example() -> dict[str, str]:
    """The variables of `deploy/harli.env.example` (the guide's sizes)."""
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            name, value = line.split("=", 1)
            values[name.strip()] = value.strip()
    return values


@dataclass
class Sizes:
    """The web and worker sizes of the `postgres` platform (the guide's variables)."""

    web_workers: int
    limit_concurrency: int
    requests_in_flight: int
    keep_alive_s: int
    worker_concurrency: int

    @classmethod
    def from_example(cls, **overrides: int | None) -> Sizes:
        example = env_example()
        values = {
            "web_workers": int(example["HARLI_WEB_WORKERS"]),
            "limit_concurrency": int(example["HARLI_WEB_LIMIT_CONCURRENCY"]),
            "requests_in_flight": int(example["HARLI_WEB_REQUESTS_IN_FLIGHT"]),
            "keep_alive_s": int(example["HARLI_WEB_KEEP_ALIVE_S"]),
            "worker_concurrency": int(example["HARLI_WORKER_CONCURRENCY"]),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass
class Platform:
    """See the module docstring. `start()`, then `tenants` holds (name, API key) pairs."""

    kind: str
    work: Path
    tenant_count: int
    sizes: Sizes | None = None
    web_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    tenants: list[tuple[str, str]] = field(default_factory=list)
    database: str = ""
    _env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("postgres", "sqlite"):
            raise ValueError(f"kind must be postgres or sqlite, got {self.kind!r}")
        if self.kind == "postgres" and self.sizes is None:
            raise ValueError("the postgres platform needs its sizes")

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    @property
    def client_headers(self) -> dict[str, str]:
        """What the load balancer adds in production (the embedded default has none)."""
        if self.kind == "postgres":
            return {"x-forwarded-proto": "https", "x-forwarded-for": "10.0.0.7"}
        return {}

    def _base_env(self) -> dict[str, str]:
        env = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("DJANGO_", "HARLI_", "CELERY_", "DATABASE_"))
        }  # fmt: skip
        env.update({
            "HARLI_STORAGE_DIR": str(self.work / "storage"),
            "HARLI_GATEWAY_SECRET": secrets.token_hex(32),
            "HARLI_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        })  # fmt: skip
        return env

    def _sqlite_env(self) -> dict[str, str]:
        # scripts/run.sh: local settings (its DEBUG default left as is), SQLite, filesystem broker
        return {
            **self._base_env(),
            "DJANGO_SETTINGS_MODULE": "config.settings.local",
            "DATABASE_URL": f"sqlite:///{self.work / 'harli.sqlite3'}",
            "CELERY_BROKER_URL": "filesystem://",
            "HARLI_BROKER_DIR": str(self.work / "broker"),
        }

    def _postgres_env(self, redis_url: str) -> dict[str, str]:
        assert self.sizes is not None
        # deploy/harli.env.example, with this run's own secrets, database and broker
        return {
            **self._base_env(),
            "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{self.database}",
            "CELERY_BROKER_URL": redis_url,
            "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
            "HARLI_TRUSTED_PROXY_HOPS": "1",
            "HARLI_WEB_REQUESTS_IN_FLIGHT": str(self.sizes.requests_in_flight),
        }

    def manage(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self._env,
            capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stderr[-3000:]}")
        return result.stdout

    def spawn(self, name: str, argv: list[str]) -> None:
        log = (self.work / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            argv, cwd=ROOT, env=self._env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        log.close()

    def log(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text(errors="replace")

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        py = sys.executable
        web = [py, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1",
               "--port", str(self.web_port), "--lifespan", "on", "--no-access-log"]  # fmt: skip
        if self.kind == "sqlite":
            self._env = self._sqlite_env()
            worker_args = ["--pool", "solo", "--without-gossip", "--without-mingle",
                           "--without-heartbeat", "-l", "WARNING"]  # fmt: skip
        else:
            assert self.sizes is not None
            password = secrets.token_hex(16)
            redis_port = free_port()
            self.spawn_redis(redis_port, password)
            self.database = f"harli_bench_{secrets.token_hex(4)}"
            self._psql(f'CREATE DATABASE "{self.database}"')
            self._env = self._postgres_env(f"redis://:{password}@127.0.0.1:{redis_port}/0")
            self.manage("check", "--deploy", "--fail-level", "WARNING")
            web += ["--workers", str(self.sizes.web_workers),
                    "--limit-concurrency", str(self.sizes.limit_concurrency),
                    "--timeout-keep-alive", str(self.sizes.keep_alive_s),
                    "--timeout-graceful-shutdown", "30", "--no-proxy-headers"]  # fmt: skip
            worker_args = ["--concurrency", str(self.sizes.worker_concurrency), "-l", "WARNING"]
        self.manage("migrate", "--no-input", "-v", "0")
        self.manage("basemodels", "register", BASE_MODEL, "--preset", BASE_MODEL)
        for i in range(self.tenant_count):
            name = f"bench-{i}"
            self.manage("tenants", "create", name)
            key = self.manage("apikeys", "issue", "--tenant", name).strip().splitlines()[-1]
            if not re.fullmatch(r"hk-\S+", key):
                raise RuntimeError(f"no API key in `apikeys issue`'s output: {key!r}")
            self.tenants.append((name, key))
        self.spawn("web", web)
        self.spawn("worker", [py, "-m", "celery", "-A", "config", "worker", "-Q", "control",
                              *worker_args])  # fmt: skip
        self.spawn("beat", [py, "-m", "celery", "-A", "config", "beat", "-l", "WARNING",
                            "--schedule", str(self.work / "celerybeat-schedule")])  # fmt: skip
        wait_for(self._ready, 90, "the web process's /readyz")

    def spawn_redis(self, port: int, password: str) -> None:
        self.spawn("redis", ["redis-server", "--bind", "127.0.0.1", "--port", str(port),
                             "--requirepass", password, "--save", "", "--appendonly", "no",
                             "--dir", str(self.work)])  # fmt: skip

    def _ready(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log(name)[-3000:]}")
        request = urllib.request.Request(f"{self.web_url}/readyz", headers=self.client_headers)
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _psql(self, sql: str) -> str:
        return subprocess.run(
            ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-Atc", sql],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip

    def connections(self) -> int | None:
        """Open connections to this run's PostgreSQL database (None on SQLite)."""
        if not self.database:
            return None
        sql = f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{self.database}'"
        return int(self._psql(sql))

    def max_connections(self) -> int | None:
        return int(self._psql("SHOW max_connections")) if self.database else None

    def rows(self) -> dict[str, Any]:
        """The benchmark's rows in the database, read by `bench.api_load.db_rows`."""
        out = subprocess.run(
            [sys.executable, "-m", "bench.api_load.db_rows"], cwd=ROOT, env=self._env,
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        return dict(json.loads(out))

    def exited(self) -> dict[str, int | None]:
        return {name: proc.poll() for name, proc in self.procs.items()}

    def web_cpu_s(self) -> float:
        """User plus system CPU time so far of the web process and its workers."""
        return group_cpu_seconds(self.procs["web"].pid)

    def stop(self) -> None:
        """SIGTERM to every process (uvicorn finishes what is in flight), SIGKILL after 40 s."""
        stop_groups(self.procs.values(), grace_s=40)

    def drop_database(self) -> None:
        if self.database:
            self._psql(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
