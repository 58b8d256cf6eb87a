"""End to end on CPU with real processes: a DPO job on a preference file trains on a host beside
decode, reports its preference metrics in events and checkpoints, and its adapter serves."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.cluster import Cluster, wait_until
from tests.e2e.conftest import Tenants

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PREFERENCES = [
    ("Q: colour of the sky?", "blue", "red"),
    ("Q: hello", "world", "numbers"),
    ("Q: the quick brown fox", "jumps over the lazy dog", "a poem"),
    ("Q: adapters", "low-rank", "continuous"),
]


def preference_jsonl() -> bytes:
    lines = [
        json.dumps(
            {
                "input": {"messages": [{"role": "user", "content": question}]},
                "preferred_output": [{"role": "assistant", "content": preferred}],
                "non_preferred_output": [{"role": "assistant", "content": other}],
            }
        )
        for question, preferred, other in PREFERENCES
    ]
    return ("\n".join(lines) + "\n").encode()


def test_dpo_job_succeeds_with_preference_metrics(cluster: Cluster, seeded: Tenants) -> None:
    client = OpenAI(base_url=f"{cluster.web_url}/v1", api_key=seeded.key, max_retries=0, timeout=30)
    upload = client.files.create(file=("prefs.jsonl", preference_jsonl()), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny",
        training_file=upload.id,
        method={
            "type": "dpo",
            "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 3, "batch_size": 2}},
        },
        suffix="dpo",
        seed=7,
    )

    def done() -> Any:
        current = client.fine_tuning.jobs.retrieve(job.id)
        if current.status in ("failed", "cancelled"):
            raise AssertionError(f"job {current.status}: {current.error}\n{cluster.logs()}")
        return current if current.status == "succeeded" else None

    finished = wait_until(done, 90, f"DPO job {job.id} to succeed", every=0.5)
    assert finished.method is not None and finished.method.type == "dpo"
    assert finished.trained_tokens is not None and finished.trained_tokens > 0
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    steps = [e for e in events if e.type == "metrics" and e.message.startswith("Step ")]
    assert sorted(e.data["step"] for e in steps) == list(range(1, 7))  # type: ignore[index]
    first = min(steps, key=lambda e: e.data["step"])  # type: ignore[index]
    assert first.data["train_loss"] == pytest.approx(0.6931, abs=1e-3)  # type: ignore[index]
    for event in steps:
        data: dict[str, Any] = event.data  # type: ignore[assignment]
        assert 0.0 <= data["train_preference_accuracy"] <= 1.0
        assert data["train_reward_margin"] == pytest.approx(
            data["train_chosen_reward"] - data["train_rejected_reward"], abs=1e-6
        )
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert checkpoints and checkpoints[0].step_number == 6
    metrics = checkpoints[0].metrics.model_dump()
    assert metrics["train_loss"] < 0.6931
    assert "train_preference_accuracy" in (checkpoints[0].metrics.model_extra or metrics)

    agent = OpenAI(base_url=cluster.agent_url("agent-a"), api_key=seeded.key, max_retries=0)
    name = finished.fine_tuned_model
    wait_until(lambda: name in [m.id for m in agent.models.list()], 20, "the adapter to serve")
    answer = agent.completions.create(model=name, prompt="Q: hello", max_tokens=3, temperature=0)
    assert answer.model == name and answer.usage is not None
