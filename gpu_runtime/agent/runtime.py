"""The host's engine-loop driver: the one engine (base model + adapters), `HostLoop` and jobs.

`HostRuntime` is the `StepDriver` of the server's `EngineLoop` (`gpu_runtime.server`), so the
OpenAI-compatible server and the co-location loop share one engine thread: inference requests
(base model or adapter by name) enter the engine through :meth:`add_request`, each
:meth:`step` is one `HostLoop.run_iteration()` (a decode step plus the finetune quanta the
policy allows), and host commands run between steps through `EngineLoop.run_in_loop`
(:func:`submit_command`). Everything here runs on that thread, except :meth:`status`, which
returns the snapshot last taken under a lock (for heartbeats).

Each turn: finished quanta become job reports (`training.HostJobs`); pauses finish at the next
optimizer-batch boundary; every `metrics_interval_s` the interval metrics go out, and the
harvest estimate of the heartbeats is refreshed (`predictor.HarvestTracker`); the heartbeat's
snapshot is taken again, its serving figures included (`reporting.ServingFigures`: scheduler
counts, KV blocks, adapter slots, and the TPOT of the last `SERVING_WINDOW_S` seconds'
decode iterations from `TpotWindow`). With a `ServerMetrics`, every iteration feeds its
iteration histogram and finetune-token counter, and its scrape-time gauges read
:meth:`gauges`, taken with the snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from gpu_runtime.agent.adapters import HostAdapters
from gpu_runtime.agent.host_factory import ServingEngine, build_host_loop
from gpu_runtime.agent.predictor import HarvestTracker, HostPredictor, load_host_predictor
from gpu_runtime.agent.reporting import (
    HostSnapshot,
    deployment_metrics,
    harli_capabilities,
    kv_bytes_per_block,
    metrics_fields,
    serving_figures,
    weights_bytes,
)
from gpu_runtime.agent.request_ids import JobRequestIds, command_job_id
from gpu_runtime.agent.serving import EngineSpec, lora_runtime
from gpu_runtime.agent.tokenizers import host_training_tokenizer
from gpu_runtime.agent.training import HostJobs, TrainingTarget
from gpu_runtime.colocation import (
    CoLocationPolicy,
    IterationRecord,
    MetricsAggregator,
    TpotWindow,
)
from gpu_runtime.contract.protocol import report
from gpu_runtime.contract.request_id import bound_log_context, current_request_id, valid_request_id
from gpu_runtime.contract.storage import Storage
from gpu_runtime.engine import Engine, RequestOutput, SamplingParams
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import EngineLoop, MetricsCollector
from gpu_runtime.server.adapter_admin import ADAPTER_LOAD_ERRORS
from gpu_runtime.server.prometheus import HostGauges, ServerMetrics

logger = logging.getLogger(__name__)
Send = Callable[[dict[str, Any]], None]
PolicyFactory = Callable[[HostPredictor | None], CoLocationPolicy]
"""Builds the co-location policy for an engine, given the host's predictor for its model."""
# With no decode work, wait this long for a concurrent quantum instead of spinning.
IDLE_FINETUNE_WAIT_S = 0.005


class HostRuntime:
    """See the module docstring."""

    def __init__(
        self,
        *,
        host: str,
        base_model: str,
        serving: ServingEngine,
        engine_spec: EngineSpec,
        policy: PolicyFactory,
        tpot_slo_ms: float,
        storage: Storage,
        work_dir: Path,
        send: Send,
        total_bytes: int,
        base_model_path: str | None,
        metrics_interval_s: float,
        request_metrics: MetricsCollector | None = None,
        predictor_path: Path | None = None,
        prometheus: ServerMetrics | None = None,
    ) -> None:
        """`predictor_path`: an artifact directory or root (`load_host_predictor`); an
        artifact that is missing or made for another model is logged and the host runs
        without (heartbeats then carry no predictor and the measured harvest rate)."""
        self.host = host
        self.base_model = base_model
        self.engine_spec = engine_spec
        self.policy_factory = policy
        self.predictor_path = predictor_path
        self.tpot_slo_ms = tpot_slo_ms
        self.aggregator = MetricsAggregator(tpot_slo_ms)
        self.tpot_window = TpotWindow(tpot_slo_ms)
        self.adapters = HostAdapters(storage, work_dir)
        self.storage = storage
        self.work_dir = Path(work_dir)
        self.send = send
        self._request_ids = JobRequestIds()
        self.total_bytes = total_bytes
        self.base_model_path = base_model_path
        self.training_tokenizer = (
            host_training_tokenizer(storage, base_model, base_model_path)
            if base_model_path
            else None
        )
        self.metrics_interval_s = metrics_interval_s
        self.request_metrics = request_metrics
        self.prometheus = prometheus
        self._decode_sm_share: float | None = None
        self._harvested_tokens_per_s: float | None = None
        self.jobs = HostJobs(
            storage=storage,
            work_dir=self.work_dir,
            report=self.report,
            jobs_changed=self.jobs_changed,
            serve_adapter=self._serve_adapter,
        )
        self._use_engine(serving)
        self._requests: dict[str, int] = {}
        """Requests in flight: their sequences not finished yet (`params.n`)."""
        self._outputs: list[RequestOutput] = []
        self._draining = False
        self._lock = threading.Lock()
        self._status = self._snapshot()
        self._gauges = self._take_gauges(self._status)
        if prometheus is not None:
            prometheus.set_gauges(self.gauges)
        self._next_metrics = time.monotonic() + metrics_interval_s

    def _use_engine(self, serving: ServingEngine) -> None:
        """Predictor, policy, loop and sizes for an engine (at start, and for a new base model);
        the loop borrows finetune memory from the engine's pool when it has one, and the jobs
        train on it (with the current base model's tokenizer and directory)."""
        engine = self._engine = serving.engine
        self._serving = serving
        self.host_memory = serving.memory
        self.predictor = None
        if self.predictor_path is not None:
            try:
                self.predictor = load_host_predictor(
                    self.predictor_path, engine=engine, base_model=self.base_model
                )
            except (RuntimeError, ValueError) as exc:  # ArtifactError, SchemaError
                logger.warning("no latency predictor for %s: %s", self.base_model, exc)
        self.loop = build_host_loop(
            serving,
            self.policy_factory(self.predictor),
            tpot_slo_ms=self.tpot_slo_ms,
            metrics_sink=self._on_record,
            output_sink=self._outputs_sink,
        )
        self.jobs.attach(
            TrainingTarget(
                self.loop, engine.runner.model, self.training_tokenizer, self.base_model_path
            )
        )
        self.weights_bytes = weights_bytes(engine)
        self.kv_bytes_per_block = kv_bytes_per_block(engine)
        parameters = sum(p.numel() for p in engine.runner.model.parameters())
        sharing = serving.sharing
        shares = (
            tuple(1.0 - d / sharing.table.total_sms for d in sharing.table.choices[:-1])
            if sharing is not None and sharing.spatial
            else ()
        )
        self.harvest = HarvestTracker(
            self.predictor,
            tpot_slo_ms=self.tpot_slo_ms,
            parameters=parameters,
            finetune_shares=shares,
        )

    def _on_record(self, record: IterationRecord) -> None:
        self.aggregator.add(record)
        self.tpot_window.observe(record)
        self.harvest.observe(record)
        if record.decode_sm_share is not None:
            self._decode_sm_share = record.decode_sm_share
        if self.prometheus is not None:
            decoded = record.decode_batch > 0 or record.prefill_tokens > 0
            if decoded:
                self.prometheus.iteration(record.iteration_ms / 1e3, record.finetune_tokens)
            elif record.finetune_tokens:
                self.prometheus.finetune_tokens.inc(record.finetune_tokens)

    # ---- any thread -----------------------------------------------------------------------
    def status(self) -> HostSnapshot:
        with self._lock:
            return self._status

    def gauges(self) -> HostGauges:
        """The Prometheus gauges taken with the last snapshot."""
        with self._lock:
            return self._gauges

    # ---- StepDriver (the loop thread) -------------------------------------------------------
    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def engine_group(self) -> Any:
        """The `EngineGroup` of the engine at tensor-parallel degree > 1, else None."""
        return self._serving.group

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        lora_name: str | None,
        tenant: str = "",
    ) -> None:
        self.loop.add_request(prompt, params, request_id, lora_name=lora_name, tenant=tenant)
        self._requests[request_id] = params.n

    def abort_request(self, request_id: str) -> None:
        self.loop.abort_request(request_id)
        self._requests.pop(request_id, None)

    def has_work(self) -> bool:
        return self.loop.has_work()

    def step(self) -> list[RequestOutput]:
        try:
            record = self.loop.run_iteration()
            self.jobs.after_iteration(record)
        except Exception as exc:  # keep the host alive; fail what was training
            self._outputs = []  # the EngineLoop fails every open stream
            self._fail_all(f"engine loop error: {exc}")
            raise
        outputs, self._outputs = self._outputs, []
        for out in outputs:
            key = out.parent_id or out.request_id
            if out.finished and key in self._requests:
                self._requests[key] -= 1
                if self._requests[key] == 0:
                    del self._requests[key]
        if not outputs and not self._engine.has_unfinished_requests():
            self.loop.wait_for_finetune(IDLE_FINETUNE_WAIT_S)
        return outputs

    def after_turn(self) -> None:
        self.jobs.finish_pauses()
        now = time.monotonic()
        if now >= self._next_metrics:
            self._send_metrics()
            self._next_metrics = now + self.metrics_interval_s
        self.refresh_status()

    def close(self) -> None:
        """Close the loop, then release the pool or stop the engine group's followers."""
        self.loop.close()
        self._serving.close()

    def jobs_changed(self) -> None:
        """A job was added to or removed from the loop: the pool lends only while one exists."""
        if self.host_memory is not None:
            self.host_memory.set_finetune_jobs(len(self.loop.job_ids))
        self.refresh_status()

    def _outputs_sink(self, outputs: list[RequestOutput]) -> None:
        self._outputs.extend(outputs)

    def _serve_adapter(self, name: str, directory: Path) -> None:
        """Serve the finished adapter in `directory` as `name` at once."""
        self.adapters.load_local(lora_runtime(self._engine), name, directory)

    def _fail_all(self, message: str) -> None:
        self.jobs.fail_all(message)
        self._requests.clear()

    # ---- commands ---------------------------------------------------------------------------
    def command(self, command: dict[str, Any]) -> None:
        """Apply one host command (see `gpu_runtime.contract.protocol`), logged under the
        request id it carries; later reports about its job carry that id. Loop thread only."""
        job_id = command_job_id(command)
        request_id = valid_request_id(command.get("request_id"))
        if job_id is not None:
            self._request_ids.remember(job_id, request_id)
        with bound_log_context(request_id=request_id, job_id=job_id):
            logger.info("handling %s %s", command["command"], command.get("command_id"),
                        extra={"command": command["command"]})  # fmt: skip
            self._apply_command(command)

    def _apply_command(self, command: dict[str, Any]) -> None:
        name = command["command"]
        group = int(command.get("engine_group") or 0)
        if group != 0 and name in ("apply_placement", "load_base_model"):
            # not the job's failure: the control plane addressed a group this agent lacks
            logger.error("dropping %s %s for engine group %s: this agent drives engine group "
                         "0 only", name, command.get("command_id"), group)  # fmt: skip
            return
        if name == "apply_placement":
            self.jobs.apply_placement(int(command["placement_id"]), dict(command["job"]))
        elif name in ("pause", "cancel"):
            self.jobs.stop(str(command["job_id"]), int(command["placement_id"]), name)
        elif name == "load_adapter":
            self._load_adapter(str(command["name"]), str(command["storage_key"]))
        elif name == "unload_adapter":
            if self.adapters.unload(lora_runtime(self._engine), str(command["name"])):
                logger.info("stopped serving %s", command["name"])
        elif name in ("drain", "undrain"):
            self._draining = name == "drain"
        elif name == "load_base_model":
            self._load_base_model(
                str(command["base_model"]), command.get("model_dir"), command.get("preset")
            )
        self.refresh_status()

    def _load_adapter(self, name: str, storage_key: str) -> None:
        """Serve the adapter tree at `storage_key` as `name`; when it cannot be (see
        `ADAPTER_LOAD_ERRORS`), nothing is served under the name and `adapter_load_failed`
        tells the control plane why."""
        try:
            self.adapters.load(lora_runtime(self._engine), name, storage_key)
        except ADAPTER_LOAD_ERRORS as exc:
            logger.error("cannot serve adapter %s from %s: %s", name, storage_key, exc)
            self.report("adapter_load_failed", name=name, storage_key=storage_key,
                        message=f"cannot serve {storage_key}: {exc}"[:1000])  # fmt: skip

    def serve_fetched(self, name: str, directory: Path, base_model: str) -> bool:
        """Serve the PEFT directory `directory` as `name` when this host still serves
        `base_model` (it was fetched for it); False otherwise. Loop thread only."""
        if base_model != self.base_model:
            return False
        self.adapters.register(lora_runtime(self._engine), name, directory)
        self.refresh_status()
        return True

    def _load_base_model(self, name: str, model_dir: str | None, preset: str | None) -> None:
        """Serve another base model. Only on an idle host (no job, no request in flight);
        otherwise the command is dropped and the control plane sends it again later. An
        engine group (tensor parallelism) is shut down and started anew over the new model."""
        if name == self.base_model:
            return
        if self.jobs.runs or self._requests:
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
        # The new model's weights need the old pool's memory; an engine group's devices (and
        # this process's torch.distributed world) are the old group's until it shut down.
        exclusive = self.host_memory is not None or self._serving.group is not None
        if exclusive:
            self.loop.close()
            self._serving.close()
        try:
            serving = self.engine_spec.build(directory)
        except Exception:
            if exclusive and self.base_model_path:  # serve the old one again
                self._use_engine(self.engine_spec.build(Path(self.base_model_path)))
            raise
        if not exclusive:
            self.loop.close()
        self.base_model, self.base_model_path = name, str(directory)
        self.training_tokenizer = host_training_tokenizer(self.storage, name, directory)
        self._use_engine(serving)
        self.adapters.forget()  # adapters of the old base model do not apply to the new one

    def refresh_status(self) -> None:
        status = self._snapshot()
        gauges = self._take_gauges(status)
        with self._lock:
            self._status = status
            self._gauges = gauges

    def _take_gauges(self, status: HostSnapshot) -> HostGauges:
        blocks = self._engine.block_manager
        serving = status.serving
        return HostGauges(
            kv_used_bytes=blocks.num_used_blocks * self.kv_bytes_per_block,
            kv_total_bytes=blocks.capacity * self.kv_bytes_per_block,
            finetune_memory_bytes=self._lent_bytes(),
            running_requests=serving.running,
            waiting_requests=serving.waiting,
            adapter_slots_used=serving.adapter_slots_used,
            adapter_slots_total=serving.adapter_slots_total,
            finetune_jobs=len(self.loop.job_ids),
            decode_sm_share=self._decode_sm_share,
            harvested_finetune_tokens_per_s=self._harvested_tokens_per_s,
            harvestable_finetune_tokens_per_s=status.harvest.tokens_per_s,
        )

    # ---- reports ----------------------------------------------------------------------------
    def report(self, kind: str, **fields: Any) -> None:
        """Send one report; a report about a job carries the request id of the latest command
        about that job (`request_ids`), else that of the command being handled."""
        request_id = self._request_ids.get(fields.get("job_id")) or current_request_id()
        if request_id is not None and "request_id" not in fields:
            fields["request_id"] = request_id
        self.send(report(kind, self.host, **fields))

    def _lent_bytes(self) -> int:
        if self.loop.memory is not None:
            return int(self.loop.memory.lent_bytes())
        return self.jobs.adapter_state_bytes()

    def _free_bytes(self) -> int:
        """Memory a new job's finetune tensors could use: the pool's pages decode does not
        hold, less what jobs already took; without a pool, what weights, the KV cache and the
        jobs' adapter state leave of the device."""
        if self.host_memory is not None:
            split = self.host_memory.split()
            return split.pool_bytes - split.decode_bytes - split.finetune_reserved_bytes
        kv_total = self._engine.config.num_kv_blocks * self.kv_bytes_per_block
        return self.total_bytes - self.weights_bytes - kv_total - self._lent_bytes()

    def _snapshot(self) -> HostSnapshot:
        lora = lora_runtime(self._engine)
        return HostSnapshot(
            base_model=self.base_model,
            placements=sorted(run.placement_id for run in self.jobs.runs.values()),
            adapters=lora.names(),
            free_bytes=max(0, self._free_bytes()),
            total_bytes=self.total_bytes,
            harvest=self.harvest.estimate,
            draining=self._draining,
            serving=serving_figures(self._engine, lora, self.tpot_window, self.loop.clock()),
            predictor=self.predictor.info if self.predictor else None,
            tensor_parallel_size=self._engine.runner.model.parallel.size,
            capabilities=harli_capabilities(lora.weights.num_slots, lora.weights.max_rank),
        )

    def _send_metrics(self) -> None:
        interval = self.aggregator.flush(self.loop.clock())
        solo = [self.loop.job_state(j).solo_tokens_per_s for j in self.loop.job_ids]
        predicted_ms, observed_ms = self.harvest.interval_done(
            interval.finetune_tokens_per_s if interval.finetune_tokens else None,
            [rate for rate in solo if rate],
        )
        kv_used = int(self._engine.block_manager.num_used_blocks)
        self._harvested_tokens_per_s = interval.finetune_tokens_per_s
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
        decode = deployment_metrics(
            interval,
            requests,
            self.predictor.info if self.predictor else None,
            predicted_ms,
            observed_ms,
        )
        self.report(
            "metrics",
            **metrics_fields(
                window_s=interval.seconds,
                host_metrics=host_metrics,
                deployment_metrics=decode,
                total_bytes=self.total_bytes,
                tensor_parallel_size=self._engine.runner.model.parallel.size,
            ),
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
