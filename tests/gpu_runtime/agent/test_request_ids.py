"""The host's side of request ids: a command is handled under the request id it carries, and
every report about its job carries the id of the latest command about that job; an inference
request's `x-request-id` is answered and on the host's access line."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from gpu_runtime.agent.cli import parse_args
from gpu_runtime.agent.request_ids import JobRequestIds
from gpu_runtime.contract.request_id import LogContextFilter, current_request_id
from gpu_runtime.server.request_ids import RequestIdMiddleware
from tests.gpu_runtime.agent.conftest import Host, Reports, job_spec


@pytest.fixture
def context_records(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.handler.addFilter(LogContextFilter())
    caplog.set_level(logging.INFO)
    return caplog


def test_reports_carry_the_request_id_of_the_latest_command_about_their_job(
    host: Host, reports: Reports, context_records: pytest.LogCaptureFixture
) -> None:
    host.command({"command": "apply_placement", "command_id": "c1", "placement_id": 1,
                  "job": job_spec(hyperparameters={"n_epochs": 10, "batch_size": 2}),
                  "request_id": "create-1"})  # fmt: skip
    assert reports.wait_for("job_started")["request_id"] == "create-1"
    assert reports.wait_for("job_progress")["request_id"] == "create-1"
    host.command({"command": "cancel", "command_id": "c2", "placement_id": 1,
                  "job_id": "ftjob-1", "request_id": "cancel-1"})  # fmt: skip
    assert reports.wait_for("job_stopped")["request_id"] == "cancel-1"
    handled = [
        (r.getMessage(), getattr(r, "request_id", None), getattr(r, "job_id", None))
        for r in context_records.records
        if r.getMessage().startswith("handling ")
    ]
    assert handled == [
        ("handling apply_placement c1", "create-1", "ftjob-1"),
        ("handling cancel c2", "cancel-1", "ftjob-1"),
    ]


def test_a_command_without_an_id_leaves_reports_without_one(host: Host, reports: Reports) -> None:
    host.command({"command": "apply_placement", "command_id": "c1", "placement_id": 1,
                  "job": job_spec()})  # fmt: skip
    assert "request_id" not in reports.wait_for("job_started")


def test_job_request_ids_are_bounded_and_skip_invalid_ones() -> None:
    ids = JobRequestIds(capacity=2)
    ids.remember("j1", "r1")
    ids.remember("j2", "bad id")
    ids.remember("j3", "r3")
    ids.remember("j1", "r1b")  # j1 is the newest now
    ids.remember("j4", "r4")
    assert [ids.get(j) for j in ("j1", "j2", "j3", "j4")] == ["r1b", None, None, "r4"]
    assert ids.get(None) is None


def test_the_agent_takes_a_log_format() -> None:
    base = ["--host", "h", "--broker", "redis://127.0.0.1:6379/0"]
    assert parse_args([*base, "--log-format", "json"]).host == "h"
    with pytest.raises(SystemExit):
        parse_args([*base, "--log-format", "xml"])


def test_the_host_server_answers_and_logs_under_the_request_id(
    context_records: pytest.LogCaptureFixture,
) -> None:
    seen: list[str | None] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(current_request_id())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-request-id", b"stale")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"{}"})

    async def call(**headers: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=RequestIdMiddleware(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://host") as client:
            return await client.post("/v1/completions", headers=headers)

    given = asyncio.run(call(**{"x-request-id": "gw-1"}))
    assert given.headers.get_list("x-request-id") == ["gw-1"]
    fresh = asyncio.run(call(**{"x-request-id": "not valid"}))
    assert fresh.headers["x-request-id"].startswith("req_")
    assert seen == ["gw-1", fresh.headers["x-request-id"]]
    access = [r for r in context_records.records if r.name == "gpu_runtime.server.access"]
    assert [(r.getMessage(), getattr(r, "request_id", None)) for r in access] == [
        ("POST /v1/completions 200", "gw-1"),
        ("POST /v1/completions 200", fresh.headers["x-request-id"]),
    ]
