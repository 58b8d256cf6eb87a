"""The processes of one benchmark run: control plane (uvicorn), worker, host agents."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.common.processes import stop_groups, wait_for
from bench.common.provenance import ROOT
from gpu_runtime.contract.grants import host_key
from gpu_runtime.server.threaded import free_port


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status < 500)
    except urllib.error.HTTPError as exc:
        return exc.code < 500
    except OSError:
        return False


@dataclass
class Platform:
    work: Path
    max_num_seqs: int
    num_kv_blocks: int
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    web_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    agent_ports: dict[str, int] = field(default_factory=dict)
    api_key: str = ""
    host_cpus: set[int] | None = None
    """CPUs the agents run on (None: any); the control plane (web, worker) gets the others."""

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "config.settings.local",
            "DJANGO_DEBUG": "0",
            "DATABASE_URL": f"sqlite:///{self.work / 'harli.sqlite3'}",
            "CELERY_BROKER_URL": "filesystem://",
            "HARLI_BROKER_DIR": str(self.work / "broker"),
            "HARLI_STORAGE_DIR": str(self.work / "storage"),
            "HARLI_GATEWAY_SECRET": self.secret,
            "HARLI_HOST_LOST_AFTER_S": "6",
            "HARLI_TORCH_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    def agent_url(self, host: str) -> str:
        return f"http://127.0.0.1:{self.agent_ports[host]}/v1"

    def host_key(self, host: str) -> str:
        return host_key(self.secret, host)

    def manage(self, *args: str) -> str:
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, check=True,
            capture_output=True, text=True,
        ).stdout  # fmt: skip

    def other_cpus(self) -> set[int] | None:
        if self.host_cpus is None:
            return None
        return set(os.sched_getaffinity(0)) - self.host_cpus

    def spawn(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        log = (self.work / f"{name}.log").open("ab")

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.procs[name] = subprocess.Popen(
            argv, cwd=ROOT, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=pin,
        )  # fmt: skip
        log.close()

    def log(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text(errors="replace")

    def start(self, hosts: tuple[str, ...], later: tuple[str, ...] = ()) -> None:
        """Register `hosts` and `later`, start the control plane and the agents of `hosts`
        (those of `later` are started with `start_agent`)."""
        self.work.mkdir(parents=True, exist_ok=True)
        self.manage("migrate", "--no-input", "-v", "0")
        seed = self.manage("seed_demo", "--url", self.web_url)
        found = re.search(r"demo tenant API key: +(hk-\w+)", seed)
        if found is None:
            raise RuntimeError(f"no API key in the seed's output:\n{seed}")
        self.api_key = found.group(1)
        for host in hosts + later:
            self.manage("hosts", "register", host, "--gpu-kind", "cpu", "--gpu-memory-gb", "16",
                        "--deployment", "tiny-chat")  # fmt: skip
        py = sys.executable
        self.spawn("web", [py, "-m", "uvicorn", "config.asgi:application", "--host",
                           "127.0.0.1", "--port", str(self.web_port), "--lifespan", "on",
                           "--no-access-log"], cpus=self.other_cpus())  # fmt: skip
        self.spawn("worker", [py, "-m", "celery", "-A", "config", "worker", "--pool", "solo",
                              "-Q", "control", "--without-gossip", "--without-mingle",
                              "--without-heartbeat", "-l", "WARNING"],
                   cpus=self.other_cpus())  # fmt: skip
        for host in hosts:
            self.start_agent(host)
        wait_for(lambda: _http_ok(f"{self.web_url}/v1/models"), 60, "the control plane")
        if hosts:
            wait_for(self._gateway_serves, 60, "the gateway to route to a host")

    def _gateway_serves(self) -> bool:
        """Whether a request through the gateway succeeds (the hosts' heartbeats applied)."""
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
        request = urllib.request.Request(
            f"{self.web_url}/v1/completions", data=body, method="POST",
            headers={"authorization": f"Bearer {self.api_key}",
                     "content-type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def start_agent(self, host: str) -> None:
        port = self.agent_ports.setdefault(host, free_port())
        env = {**self.env, "HARLI_HOST_KEY": self.host_key(host)}
        self.spawn(host, [
            sys.executable, "-m", "gpu_runtime.agent", "--host", host, "--base-model", "tiny",
            "--control-url", self.web_url, "--listen", f"127.0.0.1:{port}",
            "--work-dir", str(self.work / host), "--heartbeat-s", "0.5",
            "--max-num-seqs", str(self.max_num_seqs), "--num-kv-blocks", str(self.num_kv_blocks),
            "--max-batched-tokens", "2048",
        ], env, cpus=self.host_cpus)  # fmt: skip
        wait_for(lambda: "ready:" in self.log(host), 180, f"agent {host}")

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash."""
        try:
            os.killpg(self.procs[name].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.procs[name].wait(10)

    def stop(self) -> None:
        stop_groups(self.procs.values(), grace_s=10)
