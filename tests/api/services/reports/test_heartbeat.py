"""Heartbeats: what a host reports of itself is recorded, and a host serving another model
is told to load its deployment's."""

from __future__ import annotations

from typing import Any

import pytest

from api.models import (
    GpuHost,
)
from tests.api.services.conftest import drain_host_queue, heartbeat

pytestmark = pytest.mark.django_db


def test_heartbeats_record_the_hosts_predictor(fleet: dict[str, GpuHost]) -> None:
    heartbeat("h1", predictor_version="v20261130T095333Z", predictor_mape=0.032)
    host = GpuHost.objects.get(name="h1")
    assert (host.predictor_version, host.predictor_mape) == ("v20261130T095333Z", 0.032)
    heartbeat("h1", predictor_version=None, predictor_mape=None)  # the agent lost it
    host.refresh_from_db()
    assert (host.predictor_version, host.predictor_mape) == (None, None)
    heartbeat("h1")  # an older agent that does not report it: left alone
    host.refresh_from_db()
    assert host.predictor_version is None


def test_a_host_serving_another_model_is_told_to_load_its_deployments(
    fleet: dict[str, GpuHost], django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1", base_model="something-else")
        heartbeat("h2")
    (command,) = drain_host_queue("h1")
    assert command["command"] == "load_base_model"
    assert (command["base_model"], command["model_dir"], command["preset"]) == (
        "tiny",
        None,
        "tiny",
    )
    assert drain_host_queue("h2") == []
