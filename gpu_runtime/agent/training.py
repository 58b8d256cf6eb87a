"""The finetune jobs placed on this host: a placement's JobSpec becomes a trainer on the
host's `HostLoop`, and finished quanta become reports (progress, checkpoints copied to storage
before they are reported, success with the adapter, which the host then serves at once).
A pause lets the loop finish the optimizer batch in progress and no more (also when that is the
last batch: the job then stops there, paused, with no success), and checkpoints there; a
placement resumed from the final checkpoint succeeds at once. Loop thread only.

`HostJobs` trains on what `attach` gave it last (the loop, the serving model, the training
tokenizer, the base model's directory: the host runtime attaches them for each base model it
serves) and talks back through its callbacks: `report` (a report to the control plane),
`jobs_changed` (a job was added or removed) and `serve_adapter` (serve a finished adapter).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_runtime.agent.job_run import (
    JobRun,
    JobSetupError,
    build_job_run,
    checkpoint_now,
    resolved_hyperparameters,
    upload_adapter,
    upload_checkpoint,
)
from gpu_runtime.agent.tp_serving import job_spec_message
from gpu_runtime.colocation import HostLoop, IterationRecord, QuantumReport
from gpu_runtime.contract.chat import ChatTokenizer
from gpu_runtime.contract.footprint import adapter_state_bytes
from gpu_runtime.contract.storage import Storage
from gpu_runtime.model import CausalLM

Report = Callable[..., None]
"""``report(kind, **fields)``: one report to the control plane (`gpu_runtime.contract.protocol`)."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingTarget:
    """What the host's jobs train on: its loop, the serving model whose weights they share, the
    training tokenizer (None: the model directory has none) and the base model's directory
    (named in checkpoints; None: none)."""

    loop: HostLoop
    serving_model: CausalLM
    tokenizer: ChatTokenizer | None
    base_model_path: str | None


class HostJobs:
    """Job id -> `JobRun` of the jobs this host trains (see the module docstring)."""

    def __init__(
        self,
        *,
        storage: Storage,
        work_dir: Path,
        report: Report,
        jobs_changed: Callable[[], None],
        serve_adapter: Callable[[str, Path], None],
    ) -> None:
        self._storage = storage
        self._work_dir = work_dir
        self._report = report
        self._jobs_changed = jobs_changed
        self._serve_adapter = serve_adapter
        self._target: TrainingTarget | None = None
        self.runs: dict[str, JobRun] = {}
        self._seen: set[int] = set()

    def attach(self, target: TrainingTarget) -> None:
        """Train on `target` from now on (jobs already placed stay on the loop they are on)."""
        self._target = target

    @property
    def target(self) -> TrainingTarget:
        if self._target is None:
            raise RuntimeError("HostJobs.attach was not called")
        return self._target

    @property
    def loop(self) -> HostLoop:
        return self.target.loop

    def apply_placement(self, placement_id: int, spec: dict[str, Any]) -> None:
        if placement_id in self._seen:
            # a redelivered or re-sent placement, or one whose stop arrived first
            logger.info("dropping placement %s of job %s: seen before", placement_id, spec["id"])
            return
        self._seen.add(placement_id)
        job_id = str(spec["id"])
        old = self.runs.pop(job_id, None)
        if old is not None:
            self.loop.remove_job(job_id)
        target = self.target
        try:
            run = build_job_run(
                spec=spec,
                placement_id=placement_id,
                serving_model=target.serving_model,
                tokenizer=target.tokenizer,
                storage=self._storage,
                work_dir=self._work_dir,
                base_model_path=target.base_model_path,
            )
        except JobSetupError as exc:
            self._report(
                "job_failed",
                placement_id=placement_id,
                job_id=job_id,
                code=exc.code,
                message=str(exc),
            )
            return
        run.started_at = time.monotonic()
        self.loop.add_job(  # the spec: each engine group follower builds the same trainer
            job_id, run.trainer, spec=job_spec_message(placement_id, spec, target.base_model_path)
        )
        self.runs[job_id] = run
        self._jobs_changed()
        self._report(
            "job_started",
            placement_id=placement_id,
            job_id=job_id,
            resumed_from_step=run.resumed_from_step,
            total_steps=run.trainer.total_steps,
            hyperparameters=resolved_hyperparameters(run.trainer),
        )
        if run.trainer.finished:
            # Resumed from its final checkpoint (a pause landed after the last step): there is
            # no quantum left to finish it, so it finishes now, from that checkpoint.
            self._succeed(run, run.workdir / "resume")

    def stop(self, job_id: str, placement_id: int, command: str) -> None:
        """Pause or cancel the run of `placement_id`. Idempotent: the control plane sends a
        stop when the pause or cancel commits and again from the heartbeats' stale-placement
        check, so a repeated stop, or one for a placement that already ended here (finished,
        stopped, moved), is logged and changes nothing. A stop that overtook its placement
        (never seen here) makes the placement be dropped when it arrives."""
        run = self.runs.get(job_id)
        if run is None or run.placement_id != placement_id:
            if placement_id not in self._seen:
                self._seen.add(placement_id)
                logger.info(
                    "%s of job %s arrived before its placement %s: that placement will be dropped",
                    command,
                    job_id,
                    placement_id,
                )
            else:
                logger.info(
                    "ignoring %s of job %s: placement %s is not training on this host",
                    command,
                    job_id,
                    placement_id,
                )
            return
        if run.stopping == "paused" and command == "pause":
            logger.info("ignoring repeated pause of job %s (placement %s)", job_id, placement_id)
            return
        logger.info("%s of job %s (placement %s) at step %s", command, job_id, placement_id,
                    run.trainer.step)  # fmt: skip
        if command == "cancel":
            self.remove(run)
            self._report(
                "job_stopped",
                placement_id=placement_id,
                job_id=job_id,
                reason="cancelled",
                step=run.trainer.step,
            )
            return
        run.stopping = "paused"
        self.loop.pause_job(job_id, at_batch_end=True)
        self.finish_pauses()

    def finish_pauses(self) -> None:
        """Pause jobs whose batch is complete (the loop runs a pausing job only to finish the
        batch in progress): checkpoint to storage, report, release."""
        for run in list(self.runs.values()):
            if run.stopping != "paused":
                continue
            in_flight = self.loop.executor.in_flight
            if in_flight is not None and in_flight.job_id == run.job_id:
                continue
            if run.trainer.has_pending_gradients:
                continue
            self._finish_pause(run)

    def _finish_pause(self, run: JobRun) -> None:
        """Report the pause's checkpoint (unless the last one reported is at this step) and
        `job_stopped`, then release the run (under tensor parallelism no checkpoint is taken
        between quanta: it stops at its last checkpoint's step): a heartbeat that no longer
        names the placement is sent after both, so the control plane can resume the job from
        that checkpoint."""
        step = run.trainer.step
        if run.checkpointed_step != step and self.target.serving_model.parallel.size > 1:
            # a checkpoint outside a quantum is a collective the followers are not sent
            logger.warning("job %s paused at step %s under tensor parallelism: it resumes from "
                           "its checkpoint of step %s", run.job_id, step,
                           run.checkpointed_step)  # fmt: skip
            step = run.checkpointed_step
        elif run.checkpointed_step != step:
            self._report_checkpoint(run, checkpoint_now(run, self.target.base_model_path))
        self._report(
            "job_stopped",
            placement_id=run.placement_id,
            job_id=run.job_id,
            reason="paused",
            step=step,
        )
        self.remove(run)

    def remove(self, run: JobRun) -> None:
        """Take the job off the loop; its captured micro-batch graphs go too (their memory
        pool can then return to the unified pool)."""
        if run.job_id in self.loop.job_ids:
            self.loop.remove_job(run.job_id)
        self.runs.pop(run.job_id, None)
        run.trainer.release_cuda_graphs()
        self._jobs_changed()

    def after_iteration(self, record: IterationRecord) -> None:
        for quantum in record.quanta:
            run = self.runs.get(quantum.job_id)
            if run is not None:
                self._account(run, quantum)

    def _account(self, run: JobRun, quantum: QuantumReport) -> None:
        if quantum.error is not None:
            self.remove(run)
            self._report(
                "job_failed",
                placement_id=run.placement_id,
                job_id=run.job_id,
                code="training_error",
                message=quantum.error,
            )
            return
        run.tokens_since_report += quantum.tokens
        if quantum.optimizer_step and run.trainer.history:
            last = run.trainer.history[-1]
            now = time.monotonic()
            elapsed = max(now - run.started_at, 1e-6)
            self._report(
                "job_progress",
                placement_id=run.placement_id,
                job_id=run.job_id,
                step=last.step,
                total_steps=run.trainer.total_steps,
                train_loss=last.loss,
                learning_rate=last.learning_rate,
                tokens_per_s=run.tokens_since_report / elapsed,
                trained_tokens=run.trained_tokens,
                train_accuracy=last.accuracy,
                **preference_metrics(run, last.step),
            )
            run.started_at, run.tokens_since_report, run.reported_step = now, 0, last.step
        if quantum.checkpoint is not None:
            self._report_checkpoint(run, Path(quantum.checkpoint))
        if quantum.job_finished:
            if run.stopping == "paused":
                # Paused on the last batch: the control plane holds the job paused; its
                # resume finishes it from the final checkpoint.
                self._finish_pause(run)
                return
            self._succeed(run, Path(quantum.checkpoint) if quantum.checkpoint else None)

    def _report_checkpoint(self, run: JobRun, local: Path) -> None:
        key = upload_checkpoint(self._storage, run, local)
        trainer = run.trainer
        metrics = trainer.checkpoints.last_metrics
        if metrics is None or metrics["step"] != trainer.step:  # a pause's checkpoint
            metrics = trainer.checkpoints.metrics(final=trainer.stream.finished)
        metrics = {k: v for k, v in metrics.items() if k != "step"}
        metrics.update(preference_metrics(run, trainer.step))
        recent = [
            {
                "step": r.step,
                "train_loss": r.loss,
                "learning_rate": r.learning_rate,
                "train_accuracy": r.accuracy,
            }
            for r in trainer.history
            if r.step > run.checkpointed_step
        ]
        self._report(
            "checkpoint",
            placement_id=run.placement_id,
            job_id=run.job_id,
            step=run.trainer.step,
            total_steps=run.trainer.total_steps,
            storage_key=key,
            metrics=metrics,
            recent_steps=recent,
        )
        run.checkpointed_step = run.trainer.step

    def _succeed(self, run: JobRun, final: Path | None) -> None:
        if final is None:
            final = checkpoint_now(run, self.target.base_model_path)
            self._report_checkpoint(run, final)
        key = upload_adapter(self._storage, run, final)
        name = str(run.spec.get("fine_tuned_model") or run.job_id)
        self._serve_adapter(name, run.workdir / "adapter")
        self.remove(run)
        history = run.trainer.history
        self._report(
            "job_succeeded",
            placement_id=run.placement_id,
            job_id=run.job_id,
            trained_tokens=run.trained_tokens,
            adapter_key=key,
            train_loss=history[-1].loss if history else None,
        )

    def fail_all(self, message: str) -> None:
        """The engine loop failed: release every job and report it failed."""
        for run in list(self.runs.values()):
            try:
                self.remove(run)
            except Exception:
                logger.exception("could not remove job %s", run.job_id)
                self.runs.pop(run.job_id, None)
            self._report(
                "job_failed",
                placement_id=run.placement_id,
                job_id=run.job_id,
                code="host_error",
                message=message,
            )

    def adapter_state_bytes(self) -> int:
        """Adapter weights, gradients and two AdamW moments of every job here (the contract's
        footprint)."""
        return sum(
            adapter_state_bytes(sum(p.numel() for p in run.trainer.params))
            for run in self.runs.values()
        )


def preference_metrics(run: JobRun, step: int) -> dict[str, float]:
    """A DPO job's preference metrics of optimizer step `step` (none for supervised jobs)."""
    records = getattr(run.trainer, "preference_history", None)
    if not records or records[-1].step != step:
        return {}
    return dict(records[-1].metrics())
