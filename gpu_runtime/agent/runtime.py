"""The engine-loop thread of a host agent: owns the `HostLoop`, its jobs and adapter engines.

Everything that touches the engine happens on this one thread. Other threads (the host-queue
consumer, the HTTP server) only put items into :attr:`HostRuntime.inbox`:

* `("command", dict)` — a host command (see `gpu_runtime.agent.protocol`);
* `("generate", Generation)` — an inference request; its future is resolved by this thread.

Each turn of the loop drains the inbox, runs one `HostLoop.run_iteration()` when there is work,
steps the adapter engines that have requests, turns finished quanta into reports (progress,
checkpoints copied to storage before they are reported, success with the adapter), finishes
pauses at the next optimizer-batch boundary, and every `metrics_interval_s` sends the
aggregated interval metrics. A status snapshot for heartbeats is refreshed under a lock.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpu_runtime.agent.adapters import AdapterEngines
from gpu_runtime.agent.jobs import (
    JobRun,
    JobSetupError,
    build_job_run,
    checkpoint_now,
    upload_adapter,
    upload_checkpoint,
)
from gpu_runtime.agent.protocol import report
from gpu_runtime.colocation import (
    CoLocationPolicy,
    HostLoop,
    IterationRecord,
    MetricsAggregator,
    QuantumReport,
)
from gpu_runtime.engine import Engine, RequestOutput, SamplingParams
from gpu_runtime.model.loader import load_model, load_tokenizer
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.storage import Storage

logger = logging.getLogger(__name__)
Send = Callable[[dict[str, Any]], None]


@dataclass
class Generation:
    """One inference request handed to the loop thread; `future` gets the final output."""

    model: str
    prompt: str | list[int]
    params: SamplingParams
    future: Future[RequestOutput] = field(default_factory=Future)
    request_id: str | None = None


@dataclass
class HostSnapshot:
    """What a heartbeat reports (a copy taken under the runtime's lock)."""

    base_model: str
    placements: list[int]
    adapters: list[str]
    free_bytes: int
    total_bytes: int
    harvestable_tokens_per_s: float
    draining: bool


class HostRuntime:
    """See the module docstring."""

    def __init__(
        self,
        *,
        host: str,
        base_model: str,
        engine: Engine,
        policy: CoLocationPolicy,
        tpot_slo_ms: float,
        adapters: AdapterEngines,
        tokenizer: Any,
        storage: Storage,
        work_dir: Path,
        send: Send,
        total_bytes: int,
        max_model_len: int,
        base_model_path: str | None,
        metrics_interval_s: float,
    ) -> None:
        self.host = host
        self.base_model = base_model
        self.engine = engine
        self.policy = policy
        self.tpot_slo_ms = tpot_slo_ms
        self.aggregator = MetricsAggregator(tpot_slo_ms)
        self.loop = self._make_loop(engine)
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.storage = storage
        self.work_dir = Path(work_dir)
        self.send = send
        self.total_bytes = total_bytes
        self.max_model_len = max_model_len
        self.base_model_path = base_model_path
        self.metrics_interval_s = metrics_interval_s
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.runs: dict[str, JobRun] = {}
        self._seen_placements: set[int] = set()
        self._generations: dict[str, Generation] = {}
        self._draining = False
        self._harvest_ema = 0.0
        self.weights_bytes = sum(
            p.numel() * p.element_size() for p in self.engine.runner.model.parameters()
        )
        self.kv_bytes_per_block = _kv_bytes_per_block(self.engine)
        self._ids = 0
        self._lock = threading.Lock()
        self._status = self._snapshot()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def _make_loop(self, engine: Engine) -> HostLoop:
        return HostLoop(
            engine,
            self.policy,
            tpot_slo_ms=self.tpot_slo_ms,
            metrics_sink=self.aggregator.add,
            output_sink=self._deliver,
        )

    # ---- other threads --------------------------------------------------------------------
    def submit_command(self, command: dict[str, Any]) -> None:
        self.inbox.put(("command", command))

    def submit_generation(self, generation: Generation) -> Future[RequestOutput]:
        self.inbox.put(("generate", generation))
        return generation.future

    def status(self) -> HostSnapshot:
        with self._lock:
            return self._status

    def served_models(self) -> list[str]:
        """The base model, then the adapters this host serves."""
        with self._lock:
            return [self._status.base_model, *self._status.adapters]

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    # ---- the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        next_metrics = time.monotonic() + self.metrics_interval_s
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                try:
                    worked = self._turn()
                except Exception as exc:  # keep the host alive; fail what was training
                    logger.exception("engine loop iteration failed")
                    self._fail_all(f"engine loop error: {exc}")
                    worked = True
                now = time.monotonic()
                if now >= next_metrics:
                    self._send_metrics()
                    next_metrics = now + self.metrics_interval_s
                self._refresh_status()
                if not worked:
                    self._wait_for_inbox(0.05)
        finally:
            self.loop.close()

    def _turn(self) -> bool:
        """One turn of work; True when something ran."""
        worked = False
        if self.loop.has_work():
            self._after_iteration(self.loop.run_iteration())
            worked = True
        for engine in self.adapters.engines():
            if engine.has_unfinished_requests():
                self._deliver(engine.step())
                worked = True
        self._finish_pauses()
        return worked

    def _fail_all(self, message: str) -> None:
        for run in list(self.runs.values()):
            try:
                self._remove(run)
            except Exception:
                logger.exception("could not remove job %s", run.job_id)
                self.runs.pop(run.job_id, None)
            self._report("job_failed", placement_id=run.placement_id, job_id=run.job_id,
                         code="host_error", message=message)  # fmt: skip
        for generation in self._generations.values():
            if not generation.future.done():
                generation.future.set_exception(RuntimeError(message))
        self._generations.clear()

    def _wait_for_inbox(self, timeout: float) -> None:
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return
        self._handle(item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        try:
            if kind == "generate":
                self._start_generation(payload)
            else:
                self._command(payload)
        except Exception as exc:  # one bad item must not stop the host
            logger.exception("engine loop could not handle %s", kind)
            if kind == "generate" and not payload.future.done():
                payload.future.set_exception(exc)

    # ---- inference ------------------------------------------------------------------------
    def _start_generation(self, generation: Generation) -> None:
        self._ids += 1
        request_id = f"gen-{self._ids}"
        generation.request_id = request_id
        adapter = self.adapters.get(generation.model)
        if adapter is not None:
            adapter.add_request(generation.prompt, generation.params, request_id)
        else:
            self.loop.add_request(generation.prompt, generation.params, request_id)
        self._generations[request_id] = generation

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                generation = self._generations.pop(output.request_id, None)
                if generation is not None and not generation.future.done():
                    generation.future.set_result(output)

    # ---- commands -------------------------------------------------------------------------
    def _command(self, command: dict[str, Any]) -> None:
        name = command["command"]
        if name == "apply_placement":
            self._apply_placement(int(command["placement_id"]), dict(command["job"]))
        elif name in ("pause", "cancel"):
            self._stop_job(str(command["job_id"]), int(command["placement_id"]), name)
        elif name == "load_adapter":
            self.adapters.load(str(command["name"]), str(command["storage_key"]))
            self._refresh_status()
        elif name == "drain":
            self._draining = True
        elif name == "load_base_model":
            self._load_base_model(
                str(command["base_model"]), command.get("model_dir"), command.get("preset")
            )

    def _load_base_model(self, name: str, model_dir: str | None, preset: str | None) -> None:
        """Serve another base model. Only on an idle host (no job, no request in flight);
        otherwise the command is dropped and the control plane sends it again later."""
        if name == self.base_model:
            return
        if self.runs or self._generations:
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
        model = load_model(directory, device=self.engine.config.device)
        tokenizer = load_tokenizer(directory)
        config = replace(
            self.engine.config,
            max_model_len=min(self.max_model_len, model.config.max_position_embeddings),
        )
        engine = Engine(model, config, tokenizer=tokenizer)
        self.loop.close()
        self.engine, self.tokenizer = engine, tokenizer
        self.loop = self._make_loop(engine)
        self.adapters = AdapterEngines(
            model, config, tokenizer, self.storage, self.work_dir,
            self.adapters.engine_config.num_kv_blocks,
        )  # fmt: skip
        self.base_model, self.base_model_path = name, str(directory)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.kv_bytes_per_block = _kv_bytes_per_block(engine)
        self._refresh_status()

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
                serving_model=self.engine.runner.model,
                tokenizer=self.tokenizer,
                storage=self.storage,
                work_dir=self.work_dir,
                max_model_len=self.max_model_len,
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
        self.adapters.load_local(name, run.workdir / "adapter")
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
        kv_total = self.engine.config.num_kv_blocks * self.kv_bytes_per_block
        free = self.total_bytes - self.weights_bytes - kv_total
        return HostSnapshot(
            base_model=self.base_model,
            placements=sorted(run.placement_id for run in self.runs.values()),
            adapters=self.adapters.names(),
            free_bytes=max(0, free - self._lent_bytes()),
            total_bytes=self.total_bytes,
            harvestable_tokens_per_s=self._harvest_ema,
            draining=self._draining,
        )

    def _send_metrics(self) -> None:
        interval = self.aggregator.flush(self.loop.clock())
        if interval.finetune_tokens:
            self._harvest_ema = 0.7 * self._harvest_ema + 0.3 * interval.finetune_tokens_per_s
        kv_used = int(self.engine.block_manager.num_used_blocks)
        status = self._snapshot()
        host_metrics = {
            "weights_bytes": self.weights_bytes,
            "kv_used_bytes": kv_used * self.kv_bytes_per_block,
            "finetune_lent_bytes": self._lent_bytes(),
            "free_bytes": status.free_bytes,
            "finetune_tokens_per_s": interval.finetune_tokens_per_s,
        }
        deployment = None
        if interval.tpot_ms_p50 is not None and interval.tpot_ms_p99 is not None:
            iterations = max(interval.decode_iterations, 1)
            deployment = {
                "tpot_p50_ms": interval.tpot_ms_p50,
                "tpot_p99_ms": interval.tpot_ms_p99,
                "slo_attainment": (
                    interval.slo_attainment
                    if interval.slo_attainment is not None
                    else interval.token_slo_attainment or 0.0
                ),
                "goodput_tokens_per_s": interval.goodput_tokens_per_s,
                "request_rate": interval.finished_requests / max(interval.seconds, 1e-9),
                "observed_iter_ms": interval.seconds * 1e3 / iterations,
                # The policies available here carry no versioned predictor yet.
                "predicted_iter_ms": None,
                "predictor_version": None,
            }
        self._report(
            "metrics",
            window_s=interval.seconds,
            host_metrics=host_metrics,
            deployment_metrics=deployment,
        )


def _kv_bytes_per_block(engine: Engine) -> int:
    config = engine.model_config
    element = 2 if engine.config.device != "cpu" else 4
    return (
        engine.config.block_size
        * config.num_hidden_layers
        * 2
        * config.num_key_value_heads
        * config.head_dim
        * element
    )
