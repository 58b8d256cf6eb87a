"""End to end on CPU with real processes: a tenant's job trains on a host agent, its adapter
serves completions, metrics land in the database, a pause or cancel stops the job on its host
within a second even while the worker reading heartbeats is stalled, a broker restart loses
nothing, and a host killed with SIGKILL hands its job to the other host, which resumes from
the last checkpoint."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from gpu_runtime.contract.storage import LocalStorage
from tests.e2e.cluster import Cluster, Proc, others_in_a_transaction, wait_until
from tests.e2e.conftest import Tenants, training_jsonl
from tests.gpu_runtime.agent.artifacts import VERSION

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _client(url: str, key: str) -> OpenAI:
    return OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)


def _create_job(client: OpenAI, *, epochs: int, batch: int, suffix: str, **extra: Any) -> Any:
    upload = client.files.create(file=("train.jsonl", training_jsonl()), purpose="fine-tune")
    multiplier = extra.pop("learning_rate_multiplier", 5)
    if extra.pop("validate", False):
        extra["validation_file"] = upload.id
    return client.fine_tuning.jobs.create(
        model="tiny",
        training_file=upload.id,
        hyperparameters={
            "n_epochs": epochs,
            "batch_size": batch,
            "learning_rate_multiplier": multiplier,
        },
        suffix=suffix,
        seed=7,
        **extra,
    )


def _wait_succeeded(client: OpenAI, job_id: str, cluster: Cluster, timeout: float) -> Any:
    def done() -> Any:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in ("failed", "cancelled"):
            raise AssertionError(f"job {job.status}: {job.error}\n{cluster.logs()}")
        return job if job.status == "succeeded" else None

    try:
        return wait_until(done, timeout, f"job {job_id} to succeed", every=0.5)
    except AssertionError:
        print(cluster.logs())
        raise


def _events(client: OpenAI, job_id: str) -> list[str]:
    messages = [event.message for event in client.fine_tuning.jobs.list_events(job_id, limit=100)]
    return messages[::-1]


def _fleet_texts(job_id: str) -> list[str]:
    """The operator's wording of the job's events (their `fleet_detail`), oldest first."""
    from api.models import JobEvent

    details = JobEvent.objects.filter(job_id=job_id, fleet_detail__isnull=False).order_by(
        "created_at", "id"
    )
    texts = details.values_list("fleet_detail", flat=True)
    return [str(dict(detail or {}).get("text", "")) for detail in texts]


def test_job_succeeds_and_its_adapter_serves_on_the_hosts(
    cluster: Cluster, seeded: Tenants
) -> None:
    from api.models import HostMetric, JobMetric, MetricRollup

    client = _client(f"{cluster.web_url}/v1", seeded.key)
    # The hosts published the tokenizer they train with; a job whose example is longer than
    # the base model's context is refused before it is queued.
    assert LocalStorage(Path(cluster.env["HARLI_STORAGE_DIR"])).exists("tokenizers/tiny/.complete")
    long = client.files.create(
        file=("long.jsonl", b'{"prompt": "' + b"word " * 600 + b'", "completion": " x"}\n'),
        purpose="fine-tune",
    )
    with pytest.raises(openai.BadRequestError) as too_long:
        client.fine_tuning.jobs.create(model="tiny", training_file=long.id)
    assert (too_long.value.code, too_long.value.param) == ("example_too_long", "training_file")
    assert "line 1 (" in too_long.value.message
    job = _create_job(client, epochs=3, batch=2, suffix="e2e", validate=True,
                      learning_rate_multiplier="auto", metadata={"run": "e2e"})  # fmt: skip
    assert job.status == "queued" and job.hyperparameters.learning_rate_multiplier == "auto"
    job = _wait_succeeded(client, job.id, cluster, timeout=60)
    assert job.fine_tuned_model.startswith("ft:tiny:acme:e2e:")
    assert job.trained_tokens > 0
    assert job.hyperparameters.learning_rate_multiplier == 1.0  # what "auto" became
    assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (3, 2)
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"run": "e2e"})] == [job.id]
    events = _events(client, job.id)
    assert "Fine-tuning started" in events
    assert any(t.startswith("Fine-tuning started on host agent-") for t in _fleet_texts(job.id))
    raw = client.fine_tuning.jobs.with_raw_response.list_events(job.id, limit=100).text
    assert "agent-" not in raw and "free_bytes" not in raw  # no fleet detail for the tenant
    assert events[-1] == f"New fine-tuned model created: {job.fine_tuned_model}"
    # HARLI_KEEP_CHECKPOINTS=1: step 10's checkpoint was written, then deleted
    assert "Checkpoint saved at step 10" in events
    (kept,) = client.fine_tuning.jobs.checkpoints.list(job.id)
    assert kept.step_number == 12
    assert kept.metrics.valid_loss is not None and kept.metrics.full_valid_loss is not None
    assert kept.metrics.train_mean_token_accuracy is not None
    stored = LocalStorage(cluster.env["HARLI_STORAGE_DIR"])
    assert stored.list_keys(f"checkpoints/{job.id}/step-000010") == []
    assert stored.exists(f"checkpoints/{job.id}/step-000012/.complete")
    (result_id,) = job.result_files
    rows = client.files.content(result_id).text.splitlines()
    assert rows[0] == "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy"
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(1, 13))
    assert rows[10].split(",")[3] and rows[12].split(",")[3]  # validation at steps 10 and 12
    assert sorted(JobMetric.objects.filter(job_id=job.id).values_list("step", flat=True)) == list(
        range(1, 13)
    )
    assert job.fine_tuned_model in [m.id for m in client.models.list()]

    for host in ("agent-a", "agent-b"):  # the host that trained it, and the other one
        agent = _client(cluster.agent_url(host), seeded.key)

        def serves(agent: OpenAI = agent) -> bool:
            return job.fine_tuned_model in [m.id for m in agent.models.list()]

        wait_until(serves, 20, f"{host} to serve the adapter")
        answer = agent.completions.create(
            model=job.fine_tuned_model, prompt="Q: hello", max_tokens=4, temperature=0
        )
        assert answer.model == job.fine_tuned_model
        assert isinstance(answer.choices[0].text, str) and answer.usage is not None
        assert 1 <= answer.usage.completion_tokens <= 4
        chunks = list(
            agent.completions.create(
                model=job.fine_tuned_model, prompt="Q: hello", max_tokens=4, temperature=0,
                stream=True, stream_options={"include_usage": True},
            )
        )  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == answer.choices[0].text
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
        chat = agent.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
        )
        assert chat.choices[0].message.role == "assistant"
        streamed = agent.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            temperature=0, stream=True,
        )  # fmt: skip
        deltas = [c.choices[0].delta for c in streamed if c.choices]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content
    outsider = _client(cluster.agent_url("agent-a"), seeded.other_key)
    assert job.fine_tuned_model not in [m.id for m in outsider.models.list()]
    with pytest.raises(openai.NotFoundError):
        outsider.completions.create(model=job.fine_tuned_model, prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        _client(cluster.agent_url("agent-a"), "hk-not-a-key").models.list()

    # agent-a reports its predictor (version, held-out MAPE) and its estimate; agent-b has none
    from api.models import GpuHost, HostAgentState, PlacementDecision

    predicted = GpuHost.objects.get(name="agent-a")
    assert (predicted.predictor_version, predicted.predictor_mape) == (VERSION, 0.032)
    assert GpuHost.objects.get(name="agent-b").predictor_version is None
    assert HostAgentState.objects.get(host__name="agent-a").harvest["source"] == "predictor"
    reasons = PlacementDecision.objects.get(placement__job_id=job.id).reasons
    sources = {row["host"]: (row["harvest"] or {}).get("source") for row in reasons["candidates"]}
    assert sources == {"agent-a": "predictor", "agent-b": "measured"}

    wait_until(lambda: HostMetric.objects.filter(host__name="agent-a").exists(), 10, "metrics")
    assert MetricRollup.objects.filter(series="host", key="agent-a").exists()
    assert MetricRollup.objects.filter(series="job", key=job.id).exists()


def test_revoked_key_stops_working_within_the_cache_ttl(cluster: Cluster, seeded: Tenants) -> None:
    from api.models import Tenant
    from api.services.apikeys import api_key_issue_for_tenant, api_key_revoke

    issued = api_key_issue_for_tenant(tenant=Tenant.objects.get(name="acme"), name="short")
    agent = _client(cluster.agent_url("agent-b"), issued.key)
    assert agent.completions.create(model="tiny", prompt="Q: hi", max_tokens=2).choices
    api_key_revoke(prefix_or_id=issued.api_key.prefix)
    revoked_at = time.monotonic()

    def refused() -> bool:
        try:
            agent.models.list()
        except openai.AuthenticationError:
            return True
        return False

    wait_until(refused, 10, "the revoked key to be refused", every=0.1)
    assert time.monotonic() - revoked_at <= 2.0 + 1.0  # TTL 2 s, plus one lookup


# How long the control queue's worker is stalled around a pause, and how soon after the pause
# the host must have stopped (the default heartbeat interval is 2 s; the e2e agents' is 0.5 s).
WORKER_STALL_S = 2.5
STOP_LANDS_WITHIN_S = 1.0


def _freeze_outside_a_transaction(worker: Proc) -> None:
    """SIGSTOP `worker` at a moment when no other session of the test database is inside a
    statement or transaction: frozen inside one, it could hold the job's row lock, and the
    pause would wait for it."""
    for _ in range(100):
        worker.signal_group(signal.SIGSTOP)
        time.sleep(0.1)  # a statement in flight finishes
        try:
            busy = others_in_a_transaction()
        except BaseException:
            worker.signal_group(signal.SIGCONT)
            raise
        if not busy:
            return
        worker.signal_group(signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("the worker was always inside a transaction")


def _with_control_worker_stalled(cluster: Cluster, action: Callable[[], bool]) -> float:
    """Run `action` (a pause or cancel through the API; it must return True) while the worker
    that applies host reports is stopped (SIGSTOP) for WORKER_STALL_S: no heartbeat is read,
    so the stale-placement check cannot stop the job; only the command sent to the host when
    the API call commits can. Returns the time just before the call."""
    worker = cluster.procs["worker"]
    _freeze_outside_a_transaction(worker)
    try:
        called_at = time.time()
        assert action()
        time.sleep(WORKER_STALL_S)
    finally:
        worker.signal_group(signal.SIGCONT)
    return called_at


def _stopped_promptly(
    client: OpenAI, cluster: Cluster, job_id: str, reason: str, called_at: float
) -> int:
    """Wait for the host's "stopped training (<reason>)" event and check that the host
    stopped (the event's `stopped_at`, the host's clock) within STOP_LANDS_WITHIN_S of the
    call, not when the worker came back. Returns the step the host stopped at."""

    def stopped() -> Any:
        events = client.fine_tuning.jobs.list_events(job_id, limit=100)
        return next((e for e in events if f"Training stopped ({reason})" in e.message), None)

    try:
        event = wait_until(stopped, 60, f"the host to stop the {reason} job")
    except AssertionError:
        print(cluster.logs())
        raise
    data = dict(event.data or {})
    late_s = float(data["stopped_at"]) - called_at
    print(f"{reason}: host stopped at step {data['step']}, {late_s:.3f} s after the call")
    assert 0 < late_s < STOP_LANDS_WITHIN_S, late_s
    assert event.message.endswith(f" at step {data['step']}")
    return int(data["step"])


def test_pause_lands_on_the_host_at_once_and_resume_continues_from_its_checkpoint(
    cluster: Cluster, seeded: Tenants
) -> None:
    from api.models import JobCheckpoint, JobMetric

    client = _client(f"{cluster.web_url}/v1", seeded.key)
    # Long enough that the pause lands mid-run (the tiny model trains about 35 steps/s here).
    job = _create_job(client, epochs=50, batch=1, suffix="pause")
    total = 50 * 8
    wait_until(lambda: JobMetric.objects.filter(job_id=job.id, step__gte=5).exists(), 60,
               "training to be under way")  # fmt: skip
    paused_at = _with_control_worker_stalled(
        cluster, lambda: client.fine_tuning.jobs.pause(job.id).status == "paused"
    )
    step = _stopped_promptly(client, cluster, job.id, "paused", paused_at)
    assert step < total
    assert JobCheckpoint.objects.filter(job_id=job.id, step=step).exists()
    # The job's steps end there, the last one trained (host's clock) right after the pause.
    steps = list(JobMetric.objects.filter(job_id=job.id).order_by("step").values_list("step", "ts"))
    assert [s for s, _ in steps] == list(range(1, step + 1))
    assert steps[-1][1].timestamp() - paused_at < STOP_LANDS_WITHIN_S

    assert client.fine_tuning.jobs.resume(job.id).status == "queued"
    _wait_succeeded(client, job.id, cluster, timeout=90)
    events = _events(client, job.id)
    assert any(m.endswith(f"from checkpoint step {step}") for m in events), events[-12:]
    steps_done = sorted(JobMetric.objects.filter(job_id=job.id).values_list("step", flat=True))
    assert steps_done == list(range(1, total + 1))


def test_cancel_lands_on_the_host_at_once(cluster: Cluster, seeded: Tenants) -> None:
    from api.models import HostAgentState, JobMetric

    client = _client(f"{cluster.web_url}/v1", seeded.key)
    job = _create_job(client, epochs=50, batch=1, suffix="cancel")
    wait_until(lambda: JobMetric.objects.filter(job_id=job.id, step__gte=5).exists(), 60,
               "training to be under way")  # fmt: skip
    cancelled_at = _with_control_worker_stalled(
        cluster, lambda: client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    )
    assert _stopped_promptly(client, cluster, job.id, "cancelled", cancelled_at) < 50 * 8
    # (Steps the host trained between the last one recorded and the cancel are not recorded:
    # reports about a cancelled job's placement are stale.)
    # Both hosts' heartbeats then name no placement; the job stays cancelled, with no model.
    wait_until(
        lambda: all(not s.placements for s in HostAgentState.objects.all()), 10, "idle hosts"
    )
    done = client.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "cancelled" and done.fine_tuned_model is None


def _uninterrupted_final_loss(cluster: Cluster, job_id: str) -> tuple[float, int]:
    """Train the same job start to finish in this process (same weights, data and settings)."""
    import torch

    from api.models import FinetuneJob
    from api.services.placement_dispatch import job_spec
    from gpu_runtime.agent.job_run import build_job_run
    from gpu_runtime.contract.tokenizer import load_training_tokenizer
    from gpu_runtime.model.loader import load_model

    job = FinetuneJob.objects.select_related("base_model", "tenant", "training_file").get(pk=job_id)
    spec = job_spec(job=job, resume=None)
    spec["checkpoint_every_steps"] = 0
    torch.set_num_threads(1)
    run = build_job_run(
        spec=spec,
        placement_id=0,
        serving_model=load_model(cluster.model_dir),
        tokenizer=load_training_tokenizer(cluster.model_dir),
        storage=LocalStorage(Path(cluster.env["HARLI_STORAGE_DIR"])),
        work_dir=cluster.tmp / "reference",
        base_model_path=None,
    )
    run.trainer.checkpoints.root = None
    while not run.trainer.finished:
        run.trainer.step_quantum(max_examples=4)
    return run.trainer.history[-1].loss, run.trained_tokens


def test_killed_host_hands_its_job_to_the_other_host(cluster: Cluster, seeded: Tenants) -> None:
    from api.models import JobCheckpoint, JobEvent, JobMetric, Placement, PlacementDecision

    client = _client(f"{cluster.web_url}/v1", seeded.key)
    job = _create_job(client, epochs=30, batch=1, suffix="failover")
    total = 30 * 8
    first = wait_until(
        lambda: Placement.objects.filter(job_id=job.id, state="active").first(), 30, "a host"
    )
    victim = first.host.name
    survivor = "agent-b" if victim == "agent-a" else "agent-a"

    def past_a_checkpoint() -> bool:
        last = JobCheckpoint.objects.filter(job_id=job.id).order_by("-step").first()
        return bool(
            last
            and last.step >= 20
            and JobMetric.objects.filter(job_id=job.id, step__gt=last.step).exists()
        )

    wait_until(past_a_checkpoint, 60, "a checkpoint with steps after it")
    cluster.procs[victim].signal_group(signal.SIGKILL)
    killed_at = time.monotonic()
    done = _wait_succeeded(client, job.id, cluster, timeout=120)
    failover_s = time.monotonic() - killed_at

    second = Placement.objects.filter(job_id=job.id).exclude(pk=first.pk).get()
    assert second.host.name == survivor and second.state == "released"
    first.refresh_from_db()
    assert first.state == "lost"
    resume = PlacementDecision.objects.get(placement=second).resume_step
    assert resume is not None and resume >= 20 and resume % 10 == 0
    events, details = _events(client, job.id), _fleet_texts(job.id)
    assert f"Training interrupted; the job resumes from checkpoint step {resume}" in events
    assert f"Placed for training, resuming from step {resume}" in events
    assert f"Fine-tuning resumed from checkpoint step {resume}" in events
    lost = [t for t in details if t.startswith(f"Host {victim} lost")]
    assert len(lost) == 1 and f"from checkpoint step {resume}" in lost[0]
    assert f"Placed on host {survivor}, resuming from step {resume}" in details
    assert f"Fine-tuning resumed on host {survivor} from checkpoint step {resume}" in details

    # The survivor trained exactly the steps after the checkpoint; nothing before it twice.
    def steps_on(host: str) -> list[int]:
        progress = JobEvent.objects.filter(
            job_id=job.id, type="metrics", fleet_detail__host=host
        )
        return sorted(int(dict(e.data or {})["step"]) for e in progress)

    assert steps_on(survivor) == list(range(resume + 1, total + 1))
    trained_by_victim = steps_on(victim)
    assert trained_by_victim[:resume] == list(range(1, resume + 1))
    # The victim reached the checkpoint; whatever it trained after it (often some steps, none
    # when SIGKILL lands right after a checkpoint) went with it and was trained again above.
    assert max(trained_by_victim) >= resume
    reference_loss, reference_tokens = _uninterrupted_final_loss(cluster, job.id)
    final = JobMetric.objects.filter(job_id=job.id, step=total).latest("ts").train_loss
    assert abs(final - reference_loss) <= 1e-3 * max(1.0, abs(reference_loss))
    assert done.trained_tokens == reference_tokens
    print(f"failover: resumed from step {resume}, job done {failover_s:.1f} s after SIGKILL")


# Last in the module: the Redis restart leaves the hosts' broker links reconnecting for a few
# seconds, which no other test should have to absorb.
def test_broker_restart_mid_job_loses_no_job_and_no_event(
    cluster: Cluster, seeded: Tenants
) -> None:
    from api.models import JobCheckpoint, JobMetric

    client = _client(f"{cluster.web_url}/v1", seeded.key)
    job = _create_job(client, epochs=15, batch=1, suffix="restart")
    total = 15 * 8
    wait_until(lambda: JobMetric.objects.filter(job_id=job.id, step__gte=10).exists(), 60,
               "training to be under way")  # fmt: skip
    cluster.restart_redis(down_s=2.0)
    before_end = JobMetric.objects.filter(job_id=job.id).count()
    assert before_end < total, "the job ended before the broker restarted; make it longer"
    job = _wait_succeeded(client, job.id, cluster, timeout=120)

    def steps() -> list[int]:
        return sorted(JobMetric.objects.filter(job_id=job.id).values_list("step", flat=True))

    # A report the worker had reserved when the broker went away comes back once the
    # visibility timeout (5 s here) has passed; one lost between Redis's BRPOP and kombu's
    # unacked bookkeeping is recovered from the next checkpoint report's recent steps. Wait
    # for them, then check nothing is doubled.
    try:
        wait_until(lambda: len(steps()) >= total, 30, "every step's report")
    except AssertionError:
        missing = sorted(set(range(1, total + 1)) - set(steps()))
        raise AssertionError(f"steps never reported: {missing}") from None
    assert steps() == list(range(1, total + 1))
    checkpoints = sorted(JobCheckpoint.objects.filter(job_id=job.id).values_list("step", flat=True))
    assert checkpoints == [total]  # HARLI_KEEP_CHECKPOINTS=1
    events = _events(client, job.id)
    saved = [int(m.rsplit(" ", 1)[1]) for m in events if m.startswith("Checkpoint saved at step")]
    assert sorted(saved) == list(range(10, total + 1, 10))
    assert sum(1 for m in events if m.startswith("Step ")) == total
    assert sum(1 for m in events if m.startswith("Fine-tuning started")) == 1
