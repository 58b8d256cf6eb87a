"""A host's side of pause and resume at the awkward moments: a pause that lands on the last
batch stops there (no success the control plane would refuse), the pause's checkpoint and
`job_stopped` go out while the host still names the placement, and a job resumed from its
final checkpoint finishes at once instead of waiting for a quantum that never comes."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gpu_runtime.agent.conftest import Host, Reports, job_spec

# 6 examples in batches of 3 (the host's policy runs 2 per quantum: 2 quanta a batch), 2 epochs.
HYPER = {"n_epochs": 2, "batch_size": 3, "learning_rate_multiplier": 5}
TOTAL_STEPS = 4


def _place(host: Host, placement_id: int, **spec: Any) -> None:
    host.command({"command": "apply_placement", "command_id": f"c{placement_id}",
                  "placement_id": placement_id, "job": job_spec(**spec)})  # fmt: skip


def _resume_at(step: int) -> dict[str, Any]:
    return {"step": step, "storage_key": f"checkpoints/ftjob-1/step-{step:06d}"}


def _pause_mid_batch(host: Host, monkeypatch: pytest.MonkeyPatch, at_step: int) -> list[int]:
    """Pause placement 1 (on the loop thread, as a command would) right after the first
    quantum of the batch that ends at step `at_step + 1`; returns the step it was paused at."""
    jobs = host.runtime.jobs
    original = jobs.after_iteration
    paused: list[int] = []

    def after_iteration(record: Any) -> None:
        original(record)
        run = jobs.runs.get("ftjob-1")
        if run is None or paused:
            return
        if run.trainer.step == at_step and run.trainer.has_pending_gradients:
            paused.append(run.trainer.step)
            jobs.stop("ftjob-1", 1, "pause")

    monkeypatch.setattr(jobs, "after_iteration", after_iteration)
    return paused


class StatusAtSend:
    """The runtime's send: records what the host's status (its heartbeats) names at each
    checkpoint and job_stopped report."""

    def __init__(self, reports: Reports) -> None:
        self.reports = reports
        self.runtime: Any = None
        self.placements: dict[str, list[int]] = {}

    def __call__(self, message: dict[str, Any]) -> None:
        if self.runtime is not None and message["kind"] in ("checkpoint", "job_stopped"):
            self.placements[message["kind"]] = list(self.runtime.status().placements)
        self.reports(message)


def test_a_pause_on_the_last_batch_stops_there_and_its_resume_finishes_at_once(
    host: Host, reports: Reports, monkeypatch: pytest.MonkeyPatch
) -> None:
    paused = _pause_mid_batch(host, monkeypatch, at_step=TOTAL_STEPS - 1)
    _place(host, 1, hyperparameters=HYPER)
    assert reports.wait_for("job_started")["total_steps"] == TOTAL_STEPS
    stopped = reports.wait_for("job_stopped")
    assert paused == [TOTAL_STEPS - 1]
    # The batch in progress finished (the last one), then the pause: no success, no adapter.
    assert (stopped["reason"], stopped["step"]) == ("paused", TOTAL_STEPS)
    assert "job_succeeded" not in reports.kinds()
    assert host.runtime.status().adapters == []
    final = [m for m in reports.seen if m["kind"] == "checkpoint"][-1]
    assert final["step"] == TOTAL_STEPS
    # Resumed from that final checkpoint: nothing is left to train, so it succeeds now.
    _place(host, 2, hyperparameters=HYPER, resume_from=_resume_at(TOTAL_STEPS))
    assert reports.wait_for("job_started")["resumed_from_step"] == TOTAL_STEPS
    done = reports.wait_for("job_succeeded", timeout=20)
    assert done["placement_id"] == 2 and done["trained_tokens"] > 0
    assert "job_progress" not in reports.kinds()[reports.kinds().index("job_stopped") :]
    assert host.runtime.status().placements == []
    assert host.runtime.status().adapters == ["ft:tiny:t1::ftjob-1"]


def test_a_pause_mid_batch_finishes_the_batch_and_reports_before_letting_go(
    tiny_model_dir: Any, storage: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.gpu_runtime.agent.conftest import make_runtime

    reports = Reports()
    send = StatusAtSend(reports)
    host = make_runtime(tiny_model_dir, storage, tmp_path / "work", send)
    send.runtime = host.runtime
    paused = _pause_mid_batch(host, monkeypatch, at_step=1)
    host.loop.start()
    try:
        _place(host, 1, hyperparameters=HYPER)
        stopped = reports.wait_for("job_stopped")
        assert paused == [1] and (stopped["reason"], stopped["step"]) == ("paused", 2)
        checkpoint = [m for m in reports.seen if m["kind"] == "checkpoint"][-1]
        assert checkpoint["step"] == 2
        # A heartbeat without the placement comes only after both reports.
        assert send.placements == {"checkpoint": [1], "job_stopped": [1]}
        assert host.runtime.status().placements == []
        steps = [m["step"] for m in reports.seen if m["kind"] == "job_progress"]
        assert steps == [1, 2]
    finally:
        host.stop()


def test_a_job_resumed_from_its_final_checkpoint_succeeds_at_once(
    host: Host, reports: Reports
) -> None:
    """The defect's host half: after a pause that landed past the last step, the resumed
    placement used to sit in the loop with nothing to train and never report."""
    _place(host, 1)
    total = reports.wait_for("job_started")["total_steps"]
    first = reports.wait_for("job_succeeded")
    _place(host, 2, resume_from=_resume_at(total))
    assert reports.wait_for("job_started")["resumed_from_step"] == total
    done = reports.wait_for("job_succeeded", timeout=20)
    assert done["placement_id"] == 2
    assert done["trained_tokens"] == first["trained_tokens"]
    assert done["train_loss"] == first["train_loss"]
    assert host.runtime.status().placements == []
