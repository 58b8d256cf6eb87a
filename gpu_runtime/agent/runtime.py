"""The host's engine-loop driver: the one engine (base model + adapters), `HostLoop` and jobs.

`HostRuntime` is the `StepDriver` of the server's `EngineLoop` (`gpu_runtime.server`), so the
OpenAI-compatible server and the co-location loop share one engine thread: inference requests
(base model or adapter by name) enter the engine through :meth:`add_request`, each
:meth:`step` is one `HostLoop.run_iteration()` (a decode step plus the finetune quanta the
policy allows), and host commands run between steps through `EngineLoop.run_in_loop`
(:func:`submit_command`). Everything here runs on that thread, except :meth:`status`, which
returns the snapshot last taken under a lock (for heartbeats).

Each turn: finished quanta become reports (progress, checkpoints copied to storage before they
are reported, success with the adapter, which is then served here at once); pauses finish at
the next optimizer-batch boundary; every `metrics_interval_s` the interval metrics go out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from gpu_runtime.agent.adapters import HostAdapters
from gpu_runtime.agent.jobs import (
    JobRun,
    JobSetupError,
    build_job_run,
    checkpoint_now,
    upload_adapter,
    upload_checkpoint,
)
from gpu_runtime.agent.protocol import report
from gpu_runtime.agent.reporting import (
    HostSnapshot,
    PredictorInfo,
    deployment_metrics,
    kv_bytes_per_block,
    weights_bytes,
)
from gpu_runtime.agent.serving import EngineSpec, lora_runtime
from gpu_runtime.colocation import (
    CoLocationPolicy,
    HostLoop,
    IterationRecord,
    MetricsAggregator,
    QuantumReport,
)
from gpu_runtime.engine import Engine, RequestOutput, SamplingParams
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import EngineLoop, MetricsCollector
from gpu_runtime.storage import Storage

logger = logging.getLogger(__name__)
Send = Callable[[dict[str, Any]], None]
# With no decode work, wait this long for a concurrent quantum instead of spinning.
IDLE_FINETUNE_WAIT_S = 0.005


class HostRuntime:
    """See the module docstring."""

    def __init__(
        self,
        *,
        host: str,
        base_model: str,
        engine: Engine,
        engine_spec: EngineSpec,
        policy: CoLocationPolicy,
        tpot_slo_ms: float,
        storage: Storage,
        work_dir: Path,
        send: Send,
        total_bytes: int,
        base_model_path: str | None,
        metrics_interval_s: float,
        request_metrics: MetricsCollector | None = None,
        predictor: PredictorInfo | None = None,
    ) -> None:
        self.host = host
        self.base_model = base_model
        self._engine = engine
        self.engine_spec = engine_spec
        self.policy = policy
        self.tpot_slo_ms = tpot_slo_ms
        self.aggregator = MetricsAggregator(tpot_slo_ms)
        self.loop = self._make_loop(engine)
        self.adapters = HostAdapters(storage, work_dir)
        self.storage = storage
        self.work_dir = Path(work_dir)
        self.send = send
        self.total_bytes = total_bytes
        self.base_model_path = base_model_path
        self.metrics_interval_s = metrics_interval_s
        self.request_metrics = request_metrics
        self.predictor = predictor
        self.runs: dict[str, JobRun] = {}
        self._seen_placements: set[int] = set()
        self._requests: set[str] = set()
        self._outputs: list[RequestOutput] = []
        self._draining = False
        self._harvest_ema = 0.0
        self._measure(engine)
        self._lock = threading.Lock()
        self._status = self._snapshot()
        self._next_metrics = time.monotonic() + metrics_interval_s

    def _make_loop(self, engine: Engine) -> HostLoop:
        return HostLoop(
            engine,
            self.policy,
            tpot_slo_ms=self.tpot_slo_ms,
            metrics_sink=self.aggregator.add,
            output_sink=self._outputs_sink,
        )

    def _measure(self, engine: Engine) -> None:
        self.weights_bytes = weights_bytes(engine)
        self.kv_bytes_per_block = kv_bytes_per_block(engine)

    # ---- any thread -----------------------------------------------------------------------
    def status(self) -> HostSnapshot:
        with self._lock:
            return self._status

    # ---- StepDriver (the loop thread) -------------------------------------------------------
    @property
    def engine(self) -> Engine:
        return self._engine

    def add_request(
        self, prompt: list[int], params: SamplingParams, request_id: str, lora_name: str | None
    ) -> None:
        if lora_name is None:
            self.loop.add_request(prompt, params, request_id)
        else:
            # HostLoop.add_request takes no adapter yet: the loop times the request's tokens
            # from its first output (no arrival time, so no TTFT there; the server has it).
            self._engine.add_request(prompt, params, request_id, lora_name)
        self._requests.add(request_id)

    def abort_request(self, request_id: str) -> None:
        self.loop.abort_request(request_id)
        self._requests.discard(request_id)

    def has_work(self) -> bool:
        return self.loop.has_work()

    def step(self) -> list[RequestOutput]:
        try:
            record = self.loop.run_iteration()
            self._after_iteration(record)
        except Exception as exc:  # keep the host alive; fail what was training
            self._fail_all(f"engine loop error: {exc}")
            raise
        outputs, self._outputs = self._outputs, []
        for out in outputs:
            if out.finished:
                self._requests.discard(out.request_id)
        if not outputs and not self._engine.has_unfinished_requests():
            self.loop.wait_for_finetune(IDLE_FINETUNE_WAIT_S)
        return outputs

    def after_turn(self) -> None:
        self._finish_pauses()
        now = time.monotonic()
        if now >= self._next_metrics:
            self._send_metrics()
            self._next_metrics = now + self.metrics_interval_s
        self._refresh_status()

    def close(self) -> None:
        self.loop.close()

    def _outputs_sink(self, outputs: list[RequestOutput]) -> None:
        self._outputs.extend(outputs)

    def _fail_all(self, message: str) -> None:
        for run in list(self.runs.values()):
            try:
                self._remove(run)
            except Exception:
                logger.exception("could not remove job %s", run.job_id)
                self.runs.pop(run.job_id, None)
            self._report("job_failed", placement_id=run.placement_id, job_id=run.job_id,
                         code="host_error", message=message)  # fmt: skip
        self._requests.clear()

    # ---- commands ---------------------------------------------------------------------------
    def command(self, command: dict[str, Any]) -> None:
        """Apply one host command (see `gpu_runtime.agent.protocol`). Loop thread only."""
        name = command["command"]
        if name == "apply_placement":
            self._apply_placement(int(command["placement_id"]), dict(command["job"]))
        elif name in ("pause", "cancel"):
            self._stop_job(str(command["job_id"]), int(command["placement_id"]), name)
        elif name == "load_adapter":
            lora = lora_runtime(self._engine)
            self.adapters.load(lora, str(command["name"]), str(command["storage_key"]))
        elif name == "drain":
            self._draining = True
        elif name == "load_base_model":
            self._load_base_model(
                str(command["base_model"]), command.get("model_dir"), command.get("preset")
            )
        self._refresh_status()

    def _load_base_model(self, name: str, model_dir: str | None, preset: str | None) -> None:
        """Serve another base model. Only on an idle host (no job, no request in flight);
        otherwise the command is dropped and the control plane sends it again later."""
        if name == self.base_model:
            return
        if self.runs or self._requests:
            logger.warning("not loading base model %s: the host is busy", name)
            return
        if model_dir:
            directory = Path(model_dir)
        elif preset == "tiny":
            directory = self.work_dir / "tiny-model"
            if not (directory / "config.json").is_file():
                build_tiny_model_dir(directory, seed=0)
        else:
            logger.error("cannot load base model %s: no model directory given", name)
            return
        engine = self.engine_spec.build(directory)
        self.loop.close()
        self._engine = engine
        self.loop = self._make_loop(engine)
        self.adapters.forget()  # adapters of the old base model do not apply to the new one
        self.base_model, self.base_model_path = name, str(directory)
        self._measure(engine)

    def _apply_placement(self, placement_id: int, spec: dict[str, Any]) -> None:
        if placement_id in self._seen_placements:
            return  # a redelivered or re-sent placement
        self._seen_placements.add(placement_id)
        job_id = str(spec["id"])
        old = self.runs.pop(job_id, None)
        if old is not None:
            self.loop.remove_job(job_id)
        try:
            run = build_job_run(
                spec=spec,
                placement_id=placement_id,
                serving_model=self._engine.runner.model,
                tokenizer=self._engine.tokenizer,
                storage=self.storage,
                work_dir=self.work_dir,
                max_model_len=self._engine.config.max_model_len,
                base_model_path=self.base_model_path,
            )
        except JobSetupError as exc:
            self._report("job_failed", placement_id=placement_id, job_id=job_id,
                         code="job_setup_failed", message=str(exc))  # fmt: skip
            return
        run.started_at = time.monotonic()
        self.loop.add_job(job_id, run.trainer)
        self.runs[job_id] = run
        self._refresh_status()
        self._report(
            "job_started",
            placement_id=placement_id,
            job_id=job_id,
            resumed_from_step=run.resumed_from_step,
            total_steps=run.trainer.total_steps,
        )

    def _stop_job(self, job_id: str, placement_id: int, command: str) -> None:
        run = self.runs.get(job_id)
        if run is None or run.placement_id != placement_id:
            return
        if command == "cancel":
            self._remove(run)
            self._report("job_stopped", placement_id=placement_id, job_id=job_id,
                         reason="cancelled", step=run.trainer.step)  # fmt: skip
            return
        run.stopping = "paused"
        self.loop.pause_job(job_id)
        self._finish_pauses()

    def _finish_pauses(self) -> None:
        """Pause jobs whose batch is complete: checkpoint to storage, report, release."""
        for run in list(self.runs.values()):
            if run.stopping != "paused":
                continue
            in_flight = self.loop.executor.in_flight
            if in_flight is not None and in_flight.job_id == run.job_id:
                continue
            if run.trainer.has_pending_gradients:
                self.loop.resume_job(run.job_id)  # finish the batch first
                continue
            self._remove(run)
            local = checkpoint_now(run, self.base_model_path)
            self._report_checkpoint(run, local)
            self._report("job_stopped", placement_id=run.placement_id, job_id=run.job_id,
                         reason="paused", step=run.trainer.step)  # fmt: skip

    def _remove(self, run: JobRun) -> None:
        if run.job_id in self.loop.job_ids:
            self.loop.remove_job(run.job_id)
        self.runs.pop(run.job_id, None)
        self._refresh_status()

    def _refresh_status(self) -> None:
        status = self._snapshot()
        with self._lock:
            self._status = status

    # ---- training results -----------------------------------------------------------------
    def _after_iteration(self, record: IterationRecord) -> None:
        for quantum in record.quanta:
            run = self.runs.get(quantum.job_id)
            if run is not None:
                self._account(run, quantum)

    def _account(self, run: JobRun, quantum: QuantumReport) -> None:
        if quantum.error is not None:
            self._remove(run)
            self._report("job_failed", placement_id=run.placement_id, job_id=run.job_id,
                         code="training_error", message=quantum.error)  # fmt: skip
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
            )
            run.started_at, run.tokens_since_report, run.reported_step = now, 0, last.step
        if quantum.checkpoint is not None:
            self._report_checkpoint(run, Path(quantum.checkpoint))
        if quantum.job_finished:
            self._succeed(run, Path(quantum.checkpoint) if quantum.checkpoint else None)

    def _report_checkpoint(self, run: JobRun, local: Path) -> None:
        key = upload_checkpoint(self.storage, run, local)
        history = run.trainer.history
        metrics: dict[str, Any] = {"train_loss": history[-1].loss if history else None}
        self._report("checkpoint", placement_id=run.placement_id, job_id=run.job_id,
                     step=run.trainer.step, storage_key=key, metrics=metrics)  # fmt: skip

    def _succeed(self, run: JobRun, final: Path | None) -> None:
        if final is None:
            final = checkpoint_now(run, self.base_model_path)
            self._report_checkpoint(run, final)
        key = upload_adapter(self.storage, run, final)
        name = str(run.spec.get("fine_tuned_model") or run.job_id)
        self.adapters.load_local(lora_runtime(self._engine), name, run.workdir / "adapter")
        self._remove(run)
        history = run.trainer.history
        self._report(
            "job_succeeded",
            placement_id=run.placement_id,
            job_id=run.job_id,
            trained_tokens=run.trained_tokens,
            adapter_key=key,
            train_loss=history[-1].loss if history else None,
        )

    # ---- reports ----------------------------------------------------------------------------
    def _report(self, kind: str, **fields: Any) -> None:
        self.send(report(kind, self.host, **fields))

    def _lent_bytes(self) -> int:
        if self.loop.memory is not None:
            return int(self.loop.memory.lent_bytes())
        # Adapter weights, gradients and two AdamW moments (fp32) of every job on the loop.
        return sum(16 * sum(p.numel() for p in run.trainer.params) for run in self.runs.values())

    def _snapshot(self) -> HostSnapshot:
        kv_total = self._engine.config.num_kv_blocks * self.kv_bytes_per_block
        free = self.total_bytes - self.weights_bytes - kv_total
        return HostSnapshot(
            base_model=self.base_model,
            placements=sorted(run.placement_id for run in self.runs.values()),
            adapters=lora_runtime(self._engine).names(),
            free_bytes=max(0, free - self._lent_bytes()),
            total_bytes=self.total_bytes,
            harvestable_tokens_per_s=self._harvest_ema,
            draining=self._draining,
            predictor=self.predictor,
        )

    def _send_metrics(self) -> None:
        interval = self.aggregator.flush(self.loop.clock())
        if interval.finetune_tokens:
            self._harvest_ema = 0.7 * self._harvest_ema + 0.3 * interval.finetune_tokens_per_s
        kv_used = int(self._engine.block_manager.num_used_blocks)
        status = self._snapshot()
        host_metrics = {
            "weights_bytes": self.weights_bytes,
            "kv_used_bytes": kv_used * self.kv_bytes_per_block,
            "finetune_lent_bytes": self._lent_bytes(),
            "free_bytes": status.free_bytes,
            "finetune_tokens_per_s": interval.finetune_tokens_per_s,
        }
        # Requests whose tokens fall in a window with no decode timing wait for the next one.
        decoded = interval.tpot_ms_p50 is not None
        requests = self.request_metrics.drain() if decoded and self.request_metrics else []
        self._report(
            "metrics",
            window_s=interval.seconds,
            host_metrics=host_metrics,
            deployment_metrics=deployment_metrics(interval, requests, self.predictor),
        )


def submit_command(loop: EngineLoop, runtime: HostRuntime, command: dict[str, Any]) -> Future[Any]:
    """Queue a host command for the loop thread; a failure is logged (and in the future)."""
    future = loop.run_in_loop(lambda: runtime.command(command))

    def log_failure(done: Future[Any]) -> None:
        exc = done.exception()
        if exc is not None:
            logger.error("host command %s failed: %s", command.get("command"), exc, exc_info=exc)

    future.add_done_callback(log_failure)
    return future


def served_models(runtime: HostRuntime) -> Sequence[str]:
    """The base model, then the adapters, as of the last snapshot (any thread)."""
    status = runtime.status()
    return [status.base_model, *status.adapters]
