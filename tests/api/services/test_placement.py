"""Placement: the host a job goes to and why, against the real database and broker client."""

from __future__ import annotations

from typing import Any

import pytest

from api.models import (
    Deployment,
    FinetuneJob,
    GpuHost,
    Placement,
    PlacementDecision,
)
from tests.api.services.conftest import GIB, drain_host_queue, heartbeat, make_host, place_now

pytestmark = pytest.mark.django_db


def test_placement_chooses_by_throughput_share_and_headroom(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.host.name == "h2"
    reasons = PlacementDecision.objects.get(placement=placement).reasons
    why = {row["host"]: row["why"] for row in reasons["candidates"]}
    assert why["h1"] == why["h2"] == "eligible"
    assert why["h3"] == "does not serve tiny"
    assert why["h4"].startswith("free 1024 B < needed")
    assert reasons["chosen"] == "h2"
    (command,) = drain_host_queue("h2")
    assert command["command"] == "apply_placement"
    assert command["placement_id"] == placement.pk
    assert command["job"]["id"] == job.id
    assert command["job"]["training_file_key"] == job.training_file.storage_key
    assert command["job"]["training_file"] == job.training_file_id
    assert command["job"]["max_seq_len"] == 512  # the tiny preset's context length
    assert command["job"]["resume_from"] is None
    assert drain_host_queue("h1") == []
    # Placing again is a no-op: one open placement per job.
    assert place_now(job, django_capture_on_commit_callbacks) is None
    assert drain_host_queue("h2") == []
    (placed,) = job.events.filter(message="Placed for training")
    detail = dict(placed.fleet_detail or {})
    assert placed.data is None
    assert detail["text"] == "Placed on host h2"
    assert detail["host"] == "h2"
    assert detail["reasons"] == reasons


def test_predicted_throughput_within_tolerance_goes_to_the_most_headroom(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    predicted = {
        "source": "predictor",
        "finetune_fraction": 0.8,
        "solo_tokens_per_s": 1200.0,
        "solo_source": "prior",
        "mode": "spatial 0.75",
        "measured_tokens_per_s": 0.0,
    }
    heartbeat("h1", harvestable_tokens_per_s=960.0, harvest=predicted, free_bytes=4 * GIB,
              predictor_version="v1", predictor_mape=0.03)  # fmt: skip
    heartbeat("h2", harvestable_tokens_per_s=900.0, harvest=predicted, free_bytes=12 * GIB,
              predictor_version="v1", predictor_mape=0.03)  # fmt: skip
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.host.name == "h2"  # 900 is within 10% of 960
    reasons = PlacementDecision.objects.get(placement=placement).reasons
    rows = {row["host"]: row for row in reasons["candidates"]}
    assert rows["h1"]["throughput_tier"] == rows["h2"]["throughput_tier"] == "best"
    assert rows["h2"]["headroom_bytes"] > rows["h1"]["headroom_bytes"]
    assert rows["h2"]["harvest"]["source"] == "predictor"
    assert rows["h2"]["predictor_version"] == "v1"
    assert "memory headroom" in reasons["policy"]
    # A clearly better predicted throughput wins over headroom; open placements share it.
    Placement.objects.filter(pk=placement.pk).delete()
    job.refresh_from_db()
    heartbeat("h1", harvestable_tokens_per_s=2000.0, harvest=predicted, free_bytes=4 * GIB)
    second = place_now(job, django_capture_on_commit_callbacks)
    assert second is not None and second.host.name == "h1"
    rows = {r["host"]: r for r in PlacementDecision.objects.get(placement=second).reasons[
        "candidates"]}  # fmt: skip
    assert rows["h2"]["throughput_tier"] == "below"


def test_no_eligible_host_waits_with_one_event(
    deployment: Deployment, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    make_host("h1", deployment)  # registered, never heartbeated: offline
    assert place_now(job, django_capture_on_commit_callbacks) is None
    assert place_now(job, django_capture_on_commit_callbacks) is None
    waiting = job.events.filter(message__startswith="Waiting for a host")
    assert [e.message for e in waiting] == ["Waiting for a host with room for this job"]
    details = [dict(e.fleet_detail or {}) for e in waiting]
    assert [d["text"] for d in details] == ["Waiting for a host (h1: host is offline)"]
    assert details[0]["candidates"][0]["host"] == "h1"


def test_a_drained_host_is_told_to_drain_and_gets_no_new_jobs(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    from api.services.fleet import host_drain

    for name in ("h1", "h2"):
        host_drain(host=fleet[name])
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h2", harvestable_tokens_per_s=300.0)
    assert [c["command"] for c in drain_host_queue("h2")] == ["drain"]
    heartbeat("h2", harvestable_tokens_per_s=300.0, draining=True)
    assert place_now(job, django_capture_on_commit_callbacks) is None
    texts = [(e.fleet_detail or {}).get("text", "") for e in job.events.all()]
    assert any("h2: host is draining" in text for text in texts)
