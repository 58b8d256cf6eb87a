"""A DPO placement on the host's engine loop (CPU): it trains beside decode to success with its
preference metrics in every progress and checkpoint report, and another host resumes it from a
checkpoint with the same losses and metrics; with a preference validation file its checkpoint
reports carry the validation DPO loss and preference accuracy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_runtime.contract.protocol import PREFERENCE_METRICS
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.finetune.dpo import PreferenceRecord
from tests.gpu_runtime.agent.conftest import Host, Reports, job_spec, make_runtime

PREFS_KEY = "files/t1/file-prefs.jsonl"
VALID_KEY = "files/t1/file-valid.jsonl"
PREFERENCES = [
    ("Q: colour of the sky?", "blue", "red"),
    ("Q: hello", "world", "numbers"),
    ("Q: adapters", "low-rank", "continuous"),
    ("Q: the sea", "a short poem about the sea", "blue"),
]


def _store_preferences(
    storage: LocalStorage, key: str = PREFS_KEY, rows: list[tuple[str, str, str]] = PREFERENCES
) -> None:
    lines = "".join(
        json.dumps(
            {
                "input": {"messages": [{"role": "user", "content": q}]},
                "preferred_output": [{"role": "assistant", "content": good}],
                "non_preferred_output": [{"role": "assistant", "content": bad}],
            }
        )
        + "\n"
        for q, good, bad in rows
    )
    storage.save(key, [lines.encode()])


def _place(host: Host, placement_id: int, **extra: Any) -> None:
    spec = job_spec(
        training_file_key=PREFS_KEY,
        method="dpo",
        hyperparameters={
            "n_epochs": 3,
            "batch_size": 2,
            "learning_rate_multiplier": 5,
            "beta": 0.2,
        },
        **extra,
    )
    host.command(
        {"command": "apply_placement", "command_id": f"c{placement_id}",
         "placement_id": placement_id, "job": spec}
    )  # fmt: skip


def test_dpo_placement_reports_preference_metrics_and_resumes_exactly(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, host: Host, reports: Reports
) -> None:
    assert list(PreferenceRecord(1, 1.0, 0.0, 0.0).metrics()) == list(PREFERENCE_METRICS)
    _store_preferences(storage)
    _place(host, 1)
    assert reports.wait_for("job_started")["total_steps"] == 6
    full = reports.wait_for("job_succeeded")
    progress = {m["step"]: m for m in reports.seen if m["kind"] == "job_progress"}
    assert sorted(progress) == [1, 2, 3, 4, 5, 6]
    assert abs(progress[1]["train_loss"] - 0.693147) < 1e-4  # step 1: policy == reference
    assert progress[1]["train_reward_margin"] == 0.0
    for report in progress.values():
        assert set(PREFERENCE_METRICS) <= set(report)
        assert report["train_accuracy"] is None  # pairs have no token targets
    checkpoints = [m for m in reports.seen if m["kind"] == "checkpoint"]
    assert [c["step"] for c in checkpoints] == [2, 4, 6]
    for checkpoint in checkpoints:
        step = progress[checkpoint["step"]]
        assert {k: checkpoint["metrics"][k] for k in PREFERENCE_METRICS} == {
            k: step[k] for k in PREFERENCE_METRICS
        }
        assert checkpoint["metrics"]["train_mean_token_accuracy"] is None
    assert storage.exists("adapters/ftjob-1/adapter_model.safetensors")
    assert host.runtime.status().adapters == ["ft:tiny:t1::ftjob-1"]

    other = Reports()
    second = make_runtime(tiny_model_dir, storage, tmp_path / "work2", other)
    second.loop.start()
    try:
        _place(second, 2, resume_from={"step": 2, "storage_key": "checkpoints/ftjob-1/step-000002"})
        assert other.wait_for("job_started")["resumed_from_step"] == 2
        done = other.wait_for("job_succeeded")
    finally:
        second.stop()
    resumed = {m["step"]: m for m in other.seen if m["kind"] == "job_progress"}
    assert sorted(resumed) == [3, 4, 5, 6]
    for step, report in resumed.items():
        assert abs(report["train_loss"] - progress[step]["train_loss"]) < 1e-5
        assert abs(report["train_reward_margin"] - progress[step]["train_reward_margin"]) < 1e-5
    assert done["trained_tokens"] == full["trained_tokens"]


def test_dpo_checkpoint_reports_carry_the_validation_loss(
    storage: LocalStorage, host: Host, reports: Reports
) -> None:
    _store_preferences(storage)
    valid = [("Q: grass?", "green", "purple"), ("Q: 2 + 2", "4", "five"), ("Q: up", "down", "x")]
    _store_preferences(storage, VALID_KEY, valid)
    _place(host, 1, validation_file="file-valid", validation_file_key=VALID_KEY)
    reports.wait_for("job_succeeded")
    checkpoints = [m["metrics"] for m in reports.seen if m["kind"] == "checkpoint"]
    assert len(checkpoints) == 3  # steps 2, 4 and 6
    for metrics in checkpoints:
        assert isinstance(metrics["valid_loss"], float) and metrics["valid_loss"] > 0
        assert 0.0 <= metrics["valid_preference_accuracy"] <= 1.0
        for key in ("train", "valid", "full_valid"):
            assert metrics[f"{key}_mean_token_accuracy"] is None
        assert set(PREFERENCE_METRICS) <= set(metrics)
    assert [m["full_valid_loss"] is None for m in checkpoints] == [True, True, False]
    assert checkpoints[-1]["full_valid_preference_accuracy"] is not None
    assert len({m["valid_loss"] for m in checkpoints}) == 3  # the adapter moved between them


def test_a_dpo_job_refuses_a_supervised_validation_file(
    storage: LocalStorage, host: Host, reports: Reports
) -> None:
    from tests.gpu_runtime.agent.conftest import TRAIN_FILE, TRAIN_KEY

    _store_preferences(storage)
    _place(host, 1, validation_file=TRAIN_FILE, validation_file_key=TRAIN_KEY)
    failed = reports.wait_for("job_failed")
    assert failed["code"] == "invalid_file_format"
    assert TRAIN_FILE in failed["message"] and "preference" in failed["message"]
    assert TRAIN_KEY not in failed["message"]
