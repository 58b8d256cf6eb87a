"""Real processes for the end-to-end tests: a private Redis, web, worker, beat and agents.

Every process runs in its own session (process group), logs to a file, and is stopped with
SIGTERM then SIGKILL by :meth:`Cluster.stop` (called from fixture finalizers), so nothing is
left behind even when a test fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll `check` until it returns something truthy; AssertionError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def others_in_a_transaction() -> bool:
    """Whether another session of the test database is inside a statement or a transaction
    (one that may hold a lock): on PostgreSQL from `pg_stat_activity`; on SQLite, where every
    transaction of the platform begins IMMEDIATE (holding the write lock), when the write lock
    cannot be taken at once."""
    import sqlite3

    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state <> 'idle'"
            )
            (busy,) = cursor.fetchone() or (0,)
        return bool(busy)
    probe = sqlite3.connect(connection.settings_dict["NAME"], timeout=0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:  # "database is locked": a writer holds the lock
        return True
    finally:
        probe.close()


def host_grant_key(host: str) -> str:
    """The key the gateway of the test settings signs `host`'s grants with."""
    from django.conf import settings

    from gpu_runtime.contract.grants import host_key

    return host_key(settings.GATEWAY_SECRET, host)


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.popen.pid, signum)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 8.0) -> None:
        if self.alive() and timeout > 0:
            self.signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Cluster:
    """The processes of one test module; `env` is what every control-plane process gets."""

    tmp: Path
    env: dict[str, str]
    redis_port: int
    web_port: int
    model_dir: Path
    redis_password: str
    """Redis requires it, as production's does; the broker URLs carry it."""
    tenant_keys: bool = True
    """Agents also accept tenants' keys without a grant (`--allow-tenant-keys`)."""
    procs: dict[str, Proc] = field(default_factory=dict)
    agent_ports: dict[str, int] = field(default_factory=dict)
    agent_extra: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """The extra options each agent was first started with (a restart passes them again)."""

    @property
    def broker_url(self) -> str:
        return f"redis://:{self.redis_password}@127.0.0.1:{self.redis_port}/0"

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    def agent_url(self, host: str) -> str:
        return f"http://127.0.0.1:{self.agent_ports[host]}/v1"

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.tmp / f"{name}.log"
        handle = log.open("ab")
        popen = subprocess.Popen(
            argv, cwd=ROOT, env=env or self.env, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        handle.close()
        proc = Proc(name, popen, log)
        self.procs[name] = proc
        return proc

    def start_redis(self) -> Proc:
        data = self.tmp / "redis"
        data.mkdir(exist_ok=True)
        # the password in a 0600 file, not on the command line
        conf = self.tmp / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text(f"requirepass {self.redis_password}\n")
        proc = self.spawn(
            "redis",
            ["redis-server", str(conf), "--port", str(self.redis_port), "--bind", "127.0.0.1",
             "--dir", str(data), "--appendonly", "yes", "--appendfsync", "always",
             "--save", ""],
        )  # fmt: skip
        wait_until(lambda: port_open(self.redis_port), 20, "redis to listen")
        return proc

    def restart_redis(self, down_s: float) -> None:
        """Stop Redis (its append-only file keeps every acknowledged write), wait, start it."""
        self.procs["redis"].stop()
        time.sleep(down_s)
        self.start_redis()

    def start_web(self, name: str = "web", port: int | None = None) -> Proc:
        """The control plane's ASGI app (API, console, gateway) under uvicorn, as `run.sh`."""
        return self.spawn(name, [sys.executable, "-m", "uvicorn", "config.asgi:application",
                                 "--host", "127.0.0.1", "--port", str(port or self.web_port),
                                 "--lifespan", "on", "--no-access-log"])  # fmt: skip

    def start_control_plane(self) -> None:
        py = sys.executable
        self.start_web()
        self.spawn("worker", [py, "-m", "celery", "-A", "config", "worker", "--pool", "solo",
                              "-Q", "control", "--hostname", f"e2e-{self.web_port}@%h",
                              "--without-gossip", "--without-mingle", "-l", "WARNING"])  # fmt: skip
        self.spawn("beat", [py, "-m", "celery", "-A", "config", "beat", "-l", "WARNING",
                            "--schedule", str(self.tmp / "beat-schedule")])  # fmt: skip

    def start_agent(self, host: str, extra: tuple[str, ...] | None = None) -> Proc:
        """Start `host`'s agent (again: on the same port, work directory and outbox, with the
        options it was first started with when `extra` is None)."""
        port = self.agent_ports.setdefault(host, free_port())
        if extra is None:
            extra = self.agent_extra.get(host, ())
        self.agent_extra.setdefault(host, extra)
        # the broker URL (with Redis's password) comes from the environment, as in the agent
        # unit of deploy/: a command line is readable by every local user
        env = {**self.env, "HARLI_TORCH_THREADS": "1", "HARLI_HOST_KEY": host_grant_key(host),
               "HARLI_BROKER_URL": self.broker_url}  # fmt: skip
        tenant_keys = ("--allow-tenant-keys",) if self.tenant_keys else ()
        return self.spawn(
            host,
            [sys.executable, "-m", "gpu_runtime.agent", "--host", host,
             "--storage", self.env["HARLI_STORAGE_DIR"],
             "--work-dir", str(self.tmp / host), "--model-dir", str(self.model_dir),
             "--control-url", self.web_url, "--listen", f"127.0.0.1:{port}",
             "--heartbeat-s", "0.5", "--metrics-interval-s", "2", "--key-cache-ttl-s", "2",
             "--num-kv-blocks", "64", *tenant_keys, *extra],
            env,
        )  # fmt: skip

    def wait_ready(self, *names: str, timeout: float = 90.0) -> None:
        def ready() -> bool:
            for name in names:
                proc = self.procs[name]
                if not proc.alive():
                    raise AssertionError(f"{name} exited:\n{proc.tail()}")
                if name == "web" and not _http_ok(f"{self.web_url}/v1/models"):
                    return False
                if name in self.agent_ports and not _http_ok(
                    self.agent_url(name).removesuffix("/v1") + "/health"
                ):
                    return False
            return True

        wait_until(ready, timeout, f"{', '.join(names)} to be ready", every=0.5)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process group at once, SIGKILL what is left after `timeout`."""
        procs = list(self.procs.values())
        for proc in procs:
            if proc.alive():
                proc.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(p.alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for proc in procs:
            proc.stop(timeout=0)

    def logs(self, lines: int = 15) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(lines)}" for p in self.procs.values())


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status < 500)
    except urllib.error.HTTPError as exc:
        return exc.code < 500
    except OSError:
        return False
