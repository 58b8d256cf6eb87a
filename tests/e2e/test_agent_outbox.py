"""An agent's reports survive its crash, on the live stack (web, worker, beat, Redis, two
agents on the tiny model): the broker goes away while a job trains, the host finishes it with
every report in its outbox on disk, the agent is killed with SIGKILL and started again on the
same outbox while the broker is still away; once the broker is back the job's reports are
applied exactly once, in order (every step, checkpoint and the success recorded, no event
twice). Then the state a crash between the broker's confirmation and the outbox's removal
leaves (reports already applied still in the outbox) is recreated and the agent restarted:
the copies are sent again and change nothing (the control plane's dedupe by message id)."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from django.utils import timezone

from tests.e2e.cluster import Cluster, wait_until
from tests.e2e.conftest import Tenants
from tests.e2e.test_platform import _client, _create_job, _events, _wait_succeeded

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def cluster_env() -> dict[str, str]:
    # A host is lost only after 5 minutes without heartbeat: the outage and the restart never
    # hand the job to the other host here, so every report of it comes from one outbox.
    return {"HARLI_HOST_LOST_AFTER_S": "300"}


def _outbox(cluster: Cluster, host: str) -> Path:
    return cluster.tmp / host / "outbox"  # the default: <work-dir>/outbox


def _kinds(outbox: Path) -> list[str]:
    """The kinds of the reports in an outbox, oldest first."""
    kinds = []
    for path in sorted(outbox.glob("*.json")):
        try:
            kinds.append(json.loads(path.read_bytes())["kind"])
        except FileNotFoundError:  # sent meanwhile
            continue
    return kinds


def _applied_once(job_id: str, total: int) -> dict[str, int]:
    """What the control plane recorded of the job, checked to be each report exactly once."""
    from api.models import FinetuneJob, JobCheckpoint, JobEvent, JobMetric, Placement

    steps = sorted(JobMetric.objects.filter(job_id=job_id).values_list("step", flat=True))
    assert steps == list(range(1, total + 1))
    events = list(JobEvent.objects.filter(job_id=job_id).values_list("message", flat=True))
    saved = sorted(int(m.rsplit(" ", 1)[1]) for m in events if m.startswith("Checkpoint saved"))
    assert saved == list(range(10, total + 1, 10))
    assert sum(1 for m in events if m.startswith("Step ")) == total
    assert sum(1 for m in events if m.startswith("Fine-tuning started")) == 1
    assert sum(1 for m in events if m.startswith("New fine-tuned model created")) == 1
    assert JobCheckpoint.objects.filter(job_id=job_id, step=total).exists()
    placements = list(Placement.objects.filter(job_id=job_id))
    assert [p.state for p in placements] == ["released"]  # never handed elsewhere
    job = FinetuneJob.objects.get(pk=job_id)
    assert job.status == "succeeded"
    return {"events": len(events), "metrics": len(steps)}


def test_reports_survive_sigkill_of_the_agent_during_a_broker_outage(
    cluster: Cluster, seeded: Tenants
) -> None:
    from api.models import Placement, ProcessedReport

    client = _client(f"{cluster.web_url}/v1", seeded.key)
    job = _create_job(client, epochs=20, batch=1, suffix="outbox")
    total = 20 * 8
    placement = wait_until(
        lambda: Placement.objects.filter(job_id=job.id, state="active").first(), 60, "a host"
    )
    host = placement.host.name
    outbox = _outbox(cluster, host)
    storage = Path(cluster.env["HARLI_STORAGE_DIR"])
    wait_until(lambda: (storage / "checkpoints" / job.id / "step-000010" / ".complete").exists(),
               60, "the host's first checkpoint")  # fmt: skip

    cluster.procs["redis"].stop()
    try:
        # The host trains on and finishes; every report since the outage waits on its disk.
        wait_until(lambda: "job_succeeded" in _kinds(outbox), 120, "the success in the outbox")
        left = _kinds(outbox)
        assert "checkpoint" in left and "heartbeat" not in left
        assert left.count("job_progress") >= 10, left
        cluster.procs[host].signal_group(signal.SIGKILL)
        cluster.procs[host].popen.wait(10)
        # nothing lost with the process (a metrics report may have joined them since)
        assert _kinds(outbox)[: len(left)] == left
        copies = cluster.tmp / "outbox-copies"  # for the second half
        shutil.copytree(outbox, copies, ignore=shutil.ignore_patterns("lock", ".*"))
        cluster.start_agent(host)  # the same outbox; the broker still away
        cluster.wait_ready(host)
        assert _kinds(outbox)[: len(left)] == left
    finally:
        cluster.start_redis()

    # The worker reconnects (up to 30 s), then applies the backlog in order.
    _wait_succeeded(client, job.id, cluster, timeout=360)

    def sent(names: list[str]) -> bool:
        return not any((outbox / name).exists() for name in names)

    first_run = sorted(p.name for p in copies.glob("*.json"))
    wait_until(lambda: sent(first_run), 60, "what the first run left to leave the outbox")
    before = _applied_once(job.id, total)
    assert ProcessedReport.objects.filter(host=host, kind="job_succeeded").count() == 1

    # A crash between the broker's confirmation and the removal leaves applied reports in the
    # outbox: put the copies of what the first run left back, as such a crash would, and
    # start the agent again on it.
    cluster.procs[host].signal_group(signal.SIGKILL)
    cluster.procs[host].popen.wait(10)
    resent = []
    for path in sorted(copies.glob("*.json")):
        resent.append(json.loads(path.read_bytes())["message_id"])
        shutil.copy(path, outbox / path.name)

    def drained() -> bool:  # nothing of the killed run still on its way (it heartbeat 2/s)
        last = ProcessedReport.objects.filter(host=host).order_by("-processed_at").first()
        return last is None or (timezone.now() - last.processed_at).total_seconds() > 3

    wait_until(drained, 60, "the worker to apply what the killed agent sent")
    assert ProcessedReport.objects.filter(message_id__in=resent).count() == len(resent)
    restarted_at = timezone.now()
    cluster.start_agent(host)
    cluster.wait_ready(host)
    # The copies are ahead of its first heartbeat on the control queue: once that heartbeat is
    # applied, so were they.
    wait_until(
        lambda: ProcessedReport.objects.filter(
            host=host, kind="heartbeat", processed_at__gt=restarted_at
        ).exists(),
        90,
        "the restarted agent's first heartbeat",
    )
    wait_until(lambda: sent(first_run), 30, "the copies to leave the outbox")
    assert _applied_once(job.id, total) == before
    assert ProcessedReport.objects.filter(message_id__in=resent).count() == len(resent)
    assert _events(client, job.id)[-1].startswith("New fine-tuned model created")
