"""The host's engine loop on CPU: a placement trains to the end, checkpoints reach storage
before they are reported, a resumed run continues exactly, pause and cancel release the job,
and the finished adapter answers generations by name on the host's one engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.engine import SamplingParams
from tests.gpu_runtime.agent.conftest import Host, Reports, job_spec, make_runtime

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _place(host: Host, placement_id: int, **spec: Any) -> None:
    host.command(
        {
            "command": "apply_placement",
            "command_id": f"c{placement_id}",
            "placement_id": placement_id,
            "job": job_spec(**spec),
        }  # fmt: skip
    )


def test_placement_runs_to_success_with_checkpoints_in_storage(
    host: Host, reports: Reports, storage: LocalStorage
) -> None:
    runtime = host.runtime
    _place(host, 1)
    _place(host, 1)  # a redelivered placement is ignored
    started = reports.wait_for("job_started")
    assert started["resumed_from_step"] == 0 and started["total_steps"] == 6
    done = reports.wait_for("job_succeeded")
    kinds = reports.kinds()
    assert kinds.count("job_started") == 1
    assert kinds.count("job_progress") == 6
    checkpoints = [m for m in reports.seen if m["kind"] == "checkpoint"]
    assert [c["step"] for c in checkpoints] == [2, 4, 6]
    # each lists the steps since the previous one (to recover progress the broker lost)
    assert [[r["step"] for r in c["recent_steps"]] for c in checkpoints] == [[1, 2], [3, 4], [5, 6]]
    for checkpoint in checkpoints:
        assert storage.exists(f"{checkpoint['storage_key']}/.complete")
    assert done["adapter_key"] == "adapters/ftjob-1"
    assert storage.exists("adapters/ftjob-1/adapter_model.safetensors")
    progress = [m["train_loss"] for m in reports.seen if m["kind"] == "job_progress"]
    assert done["train_loss"] == progress[-1]
    assert done["trained_tokens"] > 0
    assert runtime.status().placements == []
    # The adapter answers by name on the same engine, and it changes the model's output.
    name = "ft:tiny:t1::ftjob-1"
    assert runtime.status().adapters == [name]
    assert runtime.engine.lora.names() == [name]
    scored = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    tuned, tuned_lp = host.generate(name, "Q: hello", scored)
    base, base_lp = host.generate("tiny", "Q: hello", scored)
    assert len(tuned.output_token_ids) == 6 and len(base.output_token_ids) == 6
    assert abs(tuned_lp[0] - base_lp[0]) > 1e-4


def test_resume_from_a_checkpoint_matches_an_uninterrupted_run(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, host: Host, reports: Reports
) -> None:
    _place(host, 1)
    full = reports.wait_for("job_succeeded")
    losses = {m["step"]: m["train_loss"] for m in reports.seen if m["kind"] == "job_progress"}
    # A second host resumes the same job from the step-2 checkpoint.
    other = Reports()
    second = make_runtime(tiny_model_dir, storage, tmp_path / "work2", other)
    second.loop.start()
    try:
        resume = {"step": 2, "storage_key": "checkpoints/ftjob-1/step-000002"}
        _place(second, 2, resume_from=resume)
        assert other.wait_for("job_started")["resumed_from_step"] == 2
        done = other.wait_for("job_succeeded")
    finally:
        second.stop()
    resumed = {m["step"]: m["train_loss"] for m in other.seen if m["kind"] == "job_progress"}
    assert sorted(resumed) == [3, 4, 5, 6]
    for step, loss in resumed.items():
        assert abs(loss - losses[step]) < 1e-5
    assert abs(done["train_loss"] - full["train_loss"]) < 1e-5
    assert done["trained_tokens"] == full["trained_tokens"]


def test_pause_checkpoints_at_a_batch_boundary_and_cancel_stops(
    host: Host, reports: Reports, storage: LocalStorage
) -> None:
    runtime = host.runtime
    _place(host, 1, hyperparameters={"n_epochs": 10, "batch_size": 2})
    reports.wait_for("job_progress")
    host.command({"command": "pause", "command_id": "p", "placement_id": 1, "job_id": "ftjob-1"})
    stopped = reports.wait_for("job_stopped")
    assert stopped["reason"] == "paused"
    checkpoint = [m for m in reports.seen if m["kind"] == "checkpoint"][-1]
    assert checkpoint["step"] == stopped["step"]
    assert storage.exists(f"{checkpoint['storage_key']}/.complete")
    assert runtime.status().placements == []
    _place(host, 2, job_id="ftjob-2", hyperparameters={"n_epochs": 10, "batch_size": 2})
    reports.wait_for("job_started")
    host.command({"command": "cancel", "command_id": "c", "placement_id": 2, "job_id": "ftjob-2"})
    assert reports.wait_for("job_stopped")["reason"] == "cancelled"
    assert "job_succeeded" not in reports.kinds()


def _stop(host: Host, command: str, placement_id: int, job_id: str = "ftjob-1") -> None:
    host.command({"command": command, "command_id": f"{command}-{placement_id}",
                  "placement_id": placement_id, "job_id": job_id})  # fmt: skip


def test_repeated_and_late_stops_are_logged_no_ops(
    host: Host, reports: Reports, caplog: Any
) -> None:
    """The control plane sends a stop at commit and again from the heartbeats' check: a
    second pause, a late pause or cancel for a placement that ended here, and one for an older
    placement of a job that runs here again change nothing and raise nothing."""
    import logging
    import time

    caplog.set_level(logging.INFO, logger="gpu_runtime.agent.training")
    _place(host, 1, hyperparameters={"n_epochs": 10, "batch_size": 2})
    reports.wait_for("job_started")
    reports.wait_for("job_progress")
    _stop(host, "pause", 1)
    _stop(host, "pause", 1)  # the heartbeat check's copy, before or after the pause finished
    stopped = reports.wait_for("job_stopped")
    assert stopped["reason"] == "paused"
    _stop(host, "pause", 1)  # late: the job is no longer here
    _stop(host, "cancel", 1)
    time.sleep(0.3)  # a few loop turns: anything they would report
    assert reports.kinds().count("job_stopped") == 1
    assert [m["step"] for m in reports.seen if m["kind"] == "checkpoint"][-1] == stopped["step"]
    ignored = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(ignored) == 3, ignored
    assert all(r.levelno == logging.INFO for r in caplog.records if "ignoring" in r.getMessage())
    # Resumed here as placement 2: a stop still in flight for placement 1 leaves it training.
    resume = {
        "step": stopped["step"],
        "storage_key": f"checkpoints/ftjob-1/step-{stopped['step']:06d}",
    }
    _place(host, 2, resume_from=resume, hyperparameters={"n_epochs": 10, "batch_size": 2})
    assert reports.wait_for("job_started")["resumed_from_step"] == stopped["step"]
    _stop(host, "cancel", 1)
    assert host.runtime.status().placements == [2]
    assert reports.wait_for("job_succeeded")["placement_id"] == 2


def test_a_stop_that_overtakes_its_placement_drops_the_placement(
    host: Host, reports: Reports
) -> None:
    """A cancel committed just after the placement (its message got to the queue first)."""
    import time

    _stop(host, "cancel", 7)
    _place(host, 7)
    time.sleep(0.3)
    assert host.runtime.status().placements == []
    assert "job_started" not in reports.kinds()
    _place(host, 8)  # the job's next placement runs
    assert reports.wait_for("job_started")["placement_id"] == 8


def test_job_setup_failures_name_files_by_id_and_never_a_location(
    host: Host, reports: Reports, storage: LocalStorage, tmp_path: Path
) -> None:
    """What a host reports reaches the tenant: file ids and line numbers, no key, no path."""
    import json

    good = json.dumps({"prompt": "Q: hi", "completion": " A: there"})
    storage.save("files/t1/file-bad.jsonl", [f"{good}\n\n{{not json\n".encode()])
    long = json.dumps({"prompt": "word " * 300, "completion": " end"})
    storage.save("files/t1/file-long.jsonl", [f"{good}\n{long}\n".encode()])
    _place(host, 1, training_file_key="files/t1/file-gone.jsonl", training_file="file-gone")
    _place(host, 2, training_file_key="files/t1/file-bad.jsonl", training_file="file-bad")
    _place(host, 3, training_file_key="files/t1/file-long.jsonl", training_file="file-long")
    _place(host, 4, resume_from={"step": 2, "storage_key": "checkpoints/ftjob-1/step-000002"})
    failed = {m["placement_id"]: m for m in (reports.wait_for("job_failed") for _ in range(4))}
    assert failed[1]["code"] == "job_setup_failed"
    assert failed[1]["message"] == "file file-gone cannot be read from storage; upload it again"
    assert failed[2]["code"] == "invalid_file_format"
    assert failed[2]["message"].startswith("file file-bad, line 3: not valid JSON (")
    assert failed[3]["code"] == "example_too_long"
    assert failed[3]["message"].startswith(
        "file file-long: 1 example(s) longer than the limit of 256 tokens: line 2 ("
    )
    assert failed[4]["message"] == "job ftjob-1: the checkpoint of step 2 cannot be restored"
    assert storage.exists("tokenizers/tiny/.complete")  # published when the host started
    for message in failed.values():
        text = message["message"]
        for location in ("files/", "checkpoints/", ".jsonl", str(storage.root), str(tmp_path)):
            assert location not in text, text


def test_metrics_and_status(host: Host, reports: Reports) -> None:
    runtime = host.runtime
    out, _ = host.generate("tiny", [5, 6, 7, 8], GREEDY)
    assert len(out.output_token_ids) == 6
    metrics = reports.wait_for("metrics", timeout=10)
    figures = metrics["host_metrics"]
    assert figures["weights_bytes"] > 0 and 0 < figures["free_bytes"] < 2**30
    status = runtime.status()
    assert status.total_bytes == 2**30 and status.placements == []


def test_drain_and_undrain_are_reported_in_the_status(host: Host) -> None:
    host.command({"command": "drain", "command_id": "d"})
    assert host.runtime.status().draining
    assert host.runtime.status().heartbeat_fields()["draining"] is True
    host.command({"command": "undrain", "command_id": "u"})
    assert not host.runtime.status().draining


def test_load_base_model_only_when_idle(host: Host, reports: Reports, tiny_model_dir: Path) -> None:
    runtime = host.runtime

    import time

    def wait_base(name: str) -> bool:
        deadline = time.monotonic() + 30
        while runtime.status().base_model != name and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(runtime.status().base_model == name)

    _place(host, 1, hyperparameters={"n_epochs": 10, "batch_size": 2})
    reports.wait_for("job_started")
    load = {"command": "load_base_model", "command_id": "b", "base_model": "tiny-2",
            "model_dir": str(tiny_model_dir), "preset": ""}  # fmt: skip
    host.command(load)  # busy training: dropped
    host.command({"command": "cancel", "command_id": "c", "placement_id": 1, "job_id": "ftjob-1"})
    reports.wait_for("job_stopped")
    assert runtime.status().base_model == "tiny"
    host.command(load)
    assert wait_base("tiny-2")
    assert runtime.status().adapters == []
    out, _ = host.generate("tiny-2", "Q: hello", GREEDY)
    assert len(out.output_token_ids) == 6


def test_a_failed_iteration_fails_the_jobs_and_serving_goes_on(
    host: Host, reports: Reports, monkeypatch: Any
) -> None:
    _place(host, 1, hyperparameters={"n_epochs": 10, "batch_size": 2})
    reports.wait_for("job_started")
    loop = host.runtime.loop
    healthy = loop.run_iteration
    failures: list[int] = []

    def fails_once() -> Any:
        if not failures:
            failures.append(1)
            raise RuntimeError("device fell over")
        return healthy()

    monkeypatch.setattr(loop, "run_iteration", fails_once)  # injected fault, once
    failed = reports.wait_for("job_failed")
    assert failed["code"] == "host_error" and "device fell over" in failed["message"]
    assert host.runtime.status().placements == []
    out, _ = host.generate("tiny", [5, 6, 7, 8], GREEDY)  # the engine thread serves on
    assert len(out.output_token_ids) == 6


def test_reports_carry_resolved_hyperparameters_accuracy_and_validation_loss(
    host: Host, reports: Reports, storage: LocalStorage
) -> None:
    from tests.gpu_runtime.agent.conftest import TRAIN_KEY

    storage.save("files/valid.jsonl", [b"".join(storage.read_chunks(TRAIN_KEY))])
    auto = {"n_epochs": "auto", "batch_size": 2, "learning_rate_multiplier": "auto"}
    _place(host, 1, validation_file_key="files/valid.jsonl", hyperparameters=auto)
    started = reports.wait_for("job_started")
    # 6 examples: "auto" epochs = clamp(ceil(300 / 6), 3, 10) = 10
    assert started["hyperparameters"] == {
        "n_epochs": 10,
        "batch_size": 2,
        "learning_rate_multiplier": 1.0,
    }
    reports.wait_for("job_succeeded", timeout=120)
    progress = [m for m in reports.seen if m["kind"] == "job_progress"]
    assert all(0.0 <= m["train_accuracy"] <= 1.0 for m in progress)
    checkpoints = [m for m in reports.seen if m["kind"] == "checkpoint"]
    assert checkpoints and all(c["metrics"]["valid_loss"] > 0 for c in checkpoints)
    assert [c["metrics"]["full_valid_loss"] is not None for c in checkpoints][-1] is True
    assert all(c["metrics"]["full_valid_loss"] is None for c in checkpoints[:-1])
    assert [c["step"] for c in checkpoints] == list(range(2, 31, 2))
    assert checkpoints[-1]["metrics"]["train_mean_token_accuracy"] == progress[-1]["train_accuracy"]
