"""`python -m gpu_runtime.agent --engine vllm` as a process, on a real `filesystem://` broker
and the real vLLM (the reference tier's environment; skips, saying why, without it): its
signed heartbeats name the pass-through as the host's URL and carry vLLM's figures, a signed
`load_adapter` command serves the adapter, and SIGTERM ends the agent and vLLM with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery
from kombu import Connection
from kombu.transport import filesystem

from gpu_runtime.agent.vllm.supervisor import log_tail
from gpu_runtime.contract.broker import broker_transport, broker_transport_options
from gpu_runtime.contract.message_auth import message_key, message_sign, message_verify
from gpu_runtime.contract.protocol import (
    CONTROL_QUEUE,
    HOST_COMMAND_TASK,
    check_report,
    host_queue,
)
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.server.threaded import free_port
from tests.gpu_runtime.agent.host_server import HOST, KEY, grant, random_adapter
from tests.gpu_runtime.agent.test_vllm_host import (
    ADAPTER,
    ADAPTER_KEY,
    _skip_without_vllm,
    complete,
    text_of,
    tiny_llama,  # noqa: F401 (fixture)
)
from tests.reference.servers import REPO

URL = "filesystem://"


@pytest.fixture()
def broker_options(tmp_path: Path) -> Iterator[dict[str, object]]:
    filesystem.Transport.global_state.clear()  # bindings of other tests' broker folders
    yield {**broker_transport_options(URL, tmp_path / "broker"), "polling_interval": 0.05}
    filesystem.Transport.global_state.clear()


def next_heartbeat(
    control: Any, agent: subprocess.Popen[bytes], log: Path, timeout_s: float, **expected: Any
) -> dict[str, Any]:
    """The next heartbeat (verified with the host's message key) whose fields include
    `expected`; AssertionError (with the agent's log) when the agent exits or `timeout_s`
    passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            raise AssertionError(f"the agent exited ({agent.returncode}):\n{log_tail(log)}")
        try:
            message = control.get(timeout=1)
        except control.Empty:
            continue
        message.ack()
        report = check_report(message_verify(message.payload[0][0], message_key(KEY)))
        if report["kind"] == "heartbeat" and expected.items() <= report.items():
            return report
    raise AssertionError(f"no heartbeat with {expected} in time:\n{log_tail(log)}")


def test_the_agent_process_serves_through_vllm(
    tiny_llama: Path,  # noqa: F811
    tmp_path: Path,
    broker_options: dict[str, object],
) -> None:
    python = _skip_without_vllm()
    storage = LocalStorage(tmp_path / "storage")
    storage.put_tree(ADAPTER_KEY, random_adapter(tiny_llama, tmp_path / "trained", seed=5))
    listen, vllm_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "gpu_runtime.agent", "--host", HOST, "--engine", "vllm",
        "--vllm-bin", str(python), "--vllm-port", str(vllm_port), "--vllm-arg=--enforce-eager",
        "--base-model", "tiny", "--model-dir", str(tiny_llama), "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", "8", "--max-batched-tokens", "256",
        "--lora-slots", "2", "--lora-max-rank", "8", "--broker", URL,
        "--broker-dir", str(tmp_path / "broker"), "--storage", str(storage.root),
        "--work-dir", str(tmp_path / "work"), "--listen", f"127.0.0.1:{listen}",
        "--heartbeat-s", "0.5", "--metrics-interval-s", "1",
    ]  # fmt: skip
    log_path = tmp_path / "agent.log"
    log = log_path.open("wb")
    env = {**os.environ, "HARLI_HOST_KEY": KEY}
    agent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                             start_new_session=True)  # fmt: skip
    broker = Connection(URL, transport=broker_transport(URL), transport_options=broker_options)
    try:
        with broker as conn:
            control = conn.SimpleQueue(CONTROL_QUEUE)
            url = f"http://127.0.0.1:{listen}/v1"
            first = next_heartbeat(control, agent, log_path, 300, server_url=url)
            assert first["free_bytes"] == 0 and first["placements"] == []
            assert first["serving"]["kv_total_pages"] > 0 and first["adapters"] == []
            app = Celery("control-plane-test", broker=URL, set_as_current=False)
            app.conf.update(broker_transport=broker_transport(URL), task_serializer="json",
                            broker_transport_options=broker_options)  # fmt: skip
            command = {"command": "load_adapter", "command_id": "c1", "name": ADAPTER,
                       "storage_key": ADAPTER_KEY}  # fmt: skip
            app.send_task(HOST_COMMAND_TASK, args=[message_sign(command, message_key(KEY))],
                          queue=host_queue(HOST), routing_key=host_queue(HOST))  # fmt: skip
            next_heartbeat(control, agent, log_path, 60, adapters=[ADAPTER])
            both = grant("tiny", ADAPTER)
            assert text_of(complete(url, ADAPTER, both)) != text_of(complete(url, "tiny", both))
            control.close()
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{vllm_port}/health")  # vLLM ended with the agent
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
        log.close()
    assert "vLLM ready" in log_path.read_text()
