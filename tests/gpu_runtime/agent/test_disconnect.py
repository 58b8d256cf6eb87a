"""A client that leaves in the middle of a stream, over a real socket: the host's engine aborts
its requests and frees their KV blocks (`EngineLoop.generate` aborts a request whose consumer
stops early; the server's stream stops consuming when uvicorn reports the disconnect)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.engine.request import Request, RequestStatus
from tests.gpu_runtime.agent.conftest import Host, Reports, make_runtime
from tests.gpu_runtime.agent.host_server import agent_config, agent_server, grant

MAX_TOKENS = 200  # far more than the stream lives for: its requests cannot finish first
BODIES: dict[str, tuple[str, dict[str, Any], int]] = {
    "chat": ("chat/completions", {"messages": [{"role": "user", "content": "Q: hello"}]}, 1),
    "completions": ("completions", {"prompt": ["Q: hello", "Q: the sea"]}, 2),
}


@pytest.fixture()
def started_host(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports
) -> Iterator[Host]:
    host = make_runtime(tiny_model_dir, storage, tmp_path / "work", reports)
    host.loop.start()
    yield host
    host.stop()


def _in_loop(host: Host, read: Callable[[], Any]) -> Any:
    """`read()` on the loop thread, between two steps (the engine is not thread-safe)."""
    return host.loop.run_in_loop(read).result(10)


def _wait_in_loop(host: Host, condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Until `condition()`, asked on the loop thread, holds (AssertionError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not _in_loop(host, condition):
        assert time.monotonic() < deadline, "the requests of a closed stream still run"
        time.sleep(0.005)


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_a_client_leaving_mid_stream_aborts_its_requests_and_frees_their_blocks(
    started_host: Host, tmp_path: Path, kind: str
) -> None:
    route, body, prompts = BODIES[kind]
    engine = started_host.runtime.engine
    blocks = engine.block_manager
    payload: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": True,
    }
    with agent_server(started_host, agent_config(tmp_path)) as url:
        with (
            httpx.Client(timeout=60) as client,
            client.stream(
                "POST", f"{url}/{route}", json=payload | body, headers=grant("tiny")
            ) as response,
        ):
            assert response.status_code == 200
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(events)
            live: list[Request] = _in_loop(
                started_host, lambda: list(engine.scheduler.requests.values())
            )
            assert len(live) == prompts
            assert all(r.status is RequestStatus.RUNNING for r in live)
            assert blocks.num_used_blocks > 0
        # the connection is closed: the host must notice long before the requests could finish
        _wait_in_loop(
            started_host, lambda: not engine.scheduler.requests and not blocks.num_used_blocks
        )
    assert [r.status for r in live] == [RequestStatus.FINISHED_ABORTED] * prompts
    assert all(len(r.output_token_ids) < MAX_TOKENS for r in live)
    assert blocks.num_free_blocks == blocks.capacity
