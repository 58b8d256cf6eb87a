"""Drive loop and backends of ``bench/colocate/run.py``: a policy on the real `HostLoop` beside the
decode engine (`LoopBackend`, which also warms every quantum size on every finetune stream before
anything is timed) or on `SimulatedHost` (`SimBackend`); requests fed on the wall clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from bench.colocate.simulator import SimulatedHost
from bench.common.timing import sync
from bench.common.traces import TraceRequest
from gpu_runtime.agent.host_factory import ServingEngine, build_host_loop
from gpu_runtime.colocation import (
    CoLocationPolicy,
    HostLoop,
    IterationRecord,
    LaunchMode,
)
from gpu_runtime.colocation.executor import QuantumTask, ThreadedExecutor, run_quantum
from gpu_runtime.colocation.loop import LAUNCH_DURING_DECODE
from gpu_runtime.colocation.types import FinishedRequest, JobView
from gpu_runtime.engine import Engine, SamplingParams
from gpu_runtime.finetune.batching import DataPosition
from gpu_runtime.finetune.trainer import LoraTrainer

QUANTUM_EXAMPLES = (1, 2, 4)
"""Quantum sizes (examples) calibration and harli use unless `--quantum-examples` says otherwise:
each (size, stream) is one CUDA graph, warmed up before the timed runs."""
BASELINE_MAX_EXAMPLES = 4
"""The largest quantum a baseline policy launches (naive's and time_slice's), whatever sizes
harli is given."""


def reset_engine(engine: Engine) -> None:
    for request_id in list(getattr(engine.scheduler, "requests", {})):
        engine.abort_request(request_id)
    engine.step()  # lets the runner drop the aborted requests' state


def drive(
    loop: HostLoop,
    trace: list[TraceRequest],
    prompts: list[list[int]],
    duration_s: float,
    stop: Callable[[list[IterationRecord]], bool] | None = None,
    running: list[FinishedRequest] | None = None,
    drain_s: float = 0.0,
) -> tuple[list[IterationRecord], float, float]:
    """Feed the trace on the wall clock for ``duration_s`` (or until ``stop(records)``, checked
    every 8 iterations), then keep iterating (the policy still planning finetune work) until
    every request has finished or ``drain_s`` more seconds have passed; returns records and
    the whole run's start and end. Requests still decoding at the end (with at least 16
    tokens) are appended to ``running`` with their TPOT so far."""
    if drain_s < 0:
        raise ValueError(f"drain_s must be >= 0, got {drain_s}")
    if running is None:
        running = []
    if len(prompts) != len(trace):
        raise ValueError(f"{len(prompts)} prompts for a trace of {len(trace)} requests")
    start = loop.clock()
    records: list[IterationRecord] = []
    try:
        _feed(loop, trace, prompts, duration_s, drain_s, stop, start, records)
    finally:  # also after an error: the engine and the worker thread serve the next run
        end = loop.clock()
        running.extend(loop.running_requests())
        loop.close()
        reset_engine(loop.engine)
    return records, start, end


def _feed(
    loop: HostLoop,
    trace: list[TraceRequest],
    prompts: list[list[int]],
    duration_s: float,
    drain_s: float,
    stop: Callable[[list[IterationRecord]], bool] | None,
    start: float,
    records: list[IterationRecord],
) -> None:
    i = 0
    while True:
        now = loop.clock() - start
        if stop is not None and len(records) % 8 == 0 and stop(records):
            break
        if now >= duration_s and (
            now >= duration_s + drain_s or not loop.engine.has_unfinished_requests()
        ):
            break
        while i < len(trace) and trace[i].arrival_s <= min(now, duration_s):
            r = trace[i]
            params = SamplingParams(
                max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True, detokenize=False
            )
            loop.add_request(prompts[i], params, f"r{r.index}", arrival=start + r.arrival_s)
            i += 1
        record = loop.run_iteration()
        records.append(record)
        if not (record.decode_batch or record.prefill_tokens):
            gap = (trace[i].arrival_s if i < len(trace) else duration_s) - (loop.clock() - start)
            gap = max(0.0, min(gap, 0.02))
            if loop.executor.in_flight is not None:
                loop.wait_for_finetune(gap)
            elif gap > 0:
                time.sleep(min(gap, 0.002))


class LoopBackend:
    """Runs a policy through the real `HostLoop` on the engine (GPU, or CPU smoke runs)."""

    def __init__(
        self, serving: ServingEngine, trainer: LoraTrainer, vocab: int, solo_tps: float
    ) -> None:
        self.serving, self.trainer = serving, trainer
        self.engine, self.sharing = engine, sharing = serving.engine, serving.sharing
        self.vocab, self.solo_tps = vocab, solo_tps
        self.choices: tuple[int, ...] = tuple(sharing.table.choices) if sharing else ()
        self.total_sms: int | None = int(sharing.table.total_sms) if sharing else None
        self._prompts: dict[tuple[int, int], list[int]] = {}
        self.last_running: list[FinishedRequest] = []
        self.stream_restarts = 0
        self.make_trainer: Callable[[bool | None], LoraTrainer] | None = None
        self.launch_during_decode = LAUNCH_DURING_DECODE  # --launch-during-decode
        # One worker thread for every run: graphed quanta warm up once per (thread, stream).
        self.executor: ThreadedExecutor | None = None
        if engine.config.is_cuda:
            self.executor = ThreadedExecutor(time.perf_counter, persistent=True)

    def run(
        self,
        policy: CoLocationPolicy,
        trace: list[TraceRequest],
        duration_s: float,
        slo_ms: float,
        with_job: bool,
        stop: Callable[[list[IterationRecord]], bool] | None = None,
        drain_s: float = 0.0,
    ) -> tuple[list[IterationRecord], float, float]:
        """``policy`` over ``trace`` (arrivals for ``duration_s``, then up to ``drain_s`` until
        every request has finished); the records and the run's start and end."""
        prompts = [self._prompt(r) for r in trace]
        if with_job and self.trainer.finished:  # must not happen (2048 examples x 50 epochs)
            print("DATA STREAM FINISHED: restarting it at epoch 0", flush=True)
            self.stream_restarts += 1
            self.trainer.stream.restore(DataPosition(0, 0))
        loop = build_host_loop(
            self.serving,
            policy,
            tpot_slo_ms=slo_ms,
            executor=self.executor,
            launch_during_decode=self.launch_during_decode,
        )
        if with_job:
            loop.add_job("ft", self.trainer)
            loop.job_state("ft").solo_tokens_per_s = self.solo_tps
        self.last_running = []
        result = drive(loop, trace, prompts, duration_s, stop, self.last_running, drain_s)
        if with_job:  # finish a layer-sliced micro-batch left open, outside the timed window
            reports = loop.job_state("ft").reports
            if reports and not reports[-1].micro_batch_done and not self.trainer.finished:
                self.trainer.step_quantum()
        return result

    def warm_quanta(self, examples: tuple[int, ...], seq_len: int) -> dict[str, Any]:
        """Run quanta of every size on every finetune stream before anything is timed, so CUDA
        graph warm-up and capture happen here, through the executor the loop uses (graphed
        quanta are launched from this thread, others run on its worker thread) for every
        split's finetune stream, then on the loop thread's own stream (after-decode quanta). A
        failing quantum is recorded (the error text); if any fails, graphs are turned off for
        the job (``trainer.disable_cuda_graphs``), the worker thread is replaced and every size
        runs again eagerly."""
        out: dict[str, Any] = {"graphs": self.trainer.graphs is not None}
        errors = self._warm_pass(examples, seq_len, out, "")
        if errors and self.trainer.graphs is not None:
            out["graphs_disabled_because"] = errors[:3]
            print(f"QUANTUM ERRORS with CUDA graphs, running eagerly: {errors[:3]}", flush=True)
            self.trainer.release_cuda_graphs()
            if self.make_trainer is not None:  # a fresh job: a failed one may stay broken
                self.trainer = self.make_trainer(False)
                out["trainer_rebuilt"] = True
            else:
                self.trainer.disable_cuda_graphs(f"warm-up quanta failed: {errors[0]}")
            if self.executor is not None:
                self.executor.shutdown()
            self.executor = ThreadedExecutor(time.perf_counter, persistent=True)
            errors = self._warm_pass(examples, seq_len, out, "eager ")
        out["errors"] = errors
        out["graph_state"] = self.graph_state()
        if errors:
            print(f"QUANTUM ERRORS: {errors[:3]}", flush=True)
        return out

    def graph_state(self) -> dict[str, Any]:
        """Whether the job's quanta replay CUDA graphs: replays / captures / eager runs so far
        and why graphs were turned off, if they were."""
        graphs = self.trainer.graphs
        if graphs is None or graphs.disabled is not None:
            return {"graphs": False, "disabled": None if graphs is None else graphs.disabled}
        return {
            "graphs": True,
            "counts": dict(getattr(graphs, "counts", {})),
            "disabled": getattr(graphs, "disabled", None),
        }

    def _warm_pass(
        self, examples: tuple[int, ...], seq_len: int, out: dict[str, Any], tag: str
    ) -> list[str]:
        """Every micro-batch row count a quantum of up to ``max(examples)`` examples can yield
        (a quantum stops at its optimizer batch's end, so a 4-example quantum two examples
        before it runs 2 rows, three before it 3) on every finetune stream: each (rows, stream)
        is its own CUDA graph, and one first seen in a timed run would be captured there (a launch
        hundreds of ms long inside a TPOT budget of a few ms). The first quantum on a stream
        runs eagerly (warm-up), so 1 comes twice."""
        errors: list[str] = []
        rows = (1, *range(1, max(examples) + 1))
        if self.executor is not None and self.sharing is not None:
            for d in self.choices:  # the worker thread, as in the loop
                stream = self.sharing.partition(d)[1]
                got: list[tuple[int, float, str | None]] = []
                for k in self._aligned(rows):
                    mode = LaunchMode.CONCURRENT
                    task = QuantumTask("ft", self.trainer, k * seq_len, mode, d, stream)
                    self.executor.submit(task)
                    if not self.executor.wait(30.0):
                        errors.append(f"worker thread, split {d}, {k} ex: no end in 30 s")
                        self.executor = None  # hung: abandon the (daemon) thread
                        return errors
                    (report,) = self.executor.poll()
                    got.append((k, round(report.duration_ms, 1), report.graph))
                    if report.error:
                        errors.append(f"worker thread, split {d}, {k} ex: {report.error}")
                out[f"{tag}worker/{d}"] = got
        got = []
        for k in self._aligned(rows):  # the loop thread's own stream: after-decode quanta
            task = QuantumTask("ft", self.trainer, k * seq_len, LaunchMode.AFTER_DECODE, None)
            report = run_quantum(task, time.perf_counter)
            got.append((k, round(report.duration_ms, 1), report.graph))
            if report.error:
                errors.append(f"loop thread, {k} ex: {report.error}")
        out[f"{tag}loop thread"] = got
        sync(self.trainer.device)
        return errors

    def _aligned(self, rows: tuple[int, ...]) -> Iterator[int]:
        """Quantum sizes that run exactly ``rows`` rows each, in order: before a size the
        optimizer batch has no room for, a quantum of what is left fills it (its row count is
        one of ``rows`` too)."""
        data = self.trainer.stream
        for k in rows:
            left = data.batch_size - data.position.index % data.batch_size
            if left < k:
                yield left
            yield k

    def _prompt(self, request: TraceRequest) -> list[int]:
        """A request's prompt ids, cached by what determines them (not by the trace object)."""
        key = (request.token_seed, request.prompt_tokens)
        if key not in self._prompts:
            self._prompts[key] = request.prompt_ids(self.vocab)
        return self._prompts[key]


class SimBackend:
    """Runs a policy on `SimulatedHost` (latencies modelled from a GPU profile; not measured)."""

    def __init__(self, host: SimulatedHost, job: JobView) -> None:
        self.host, self.job = host, job
        self.last_running: list[FinishedRequest] = []
        self.choices = host.decode_sms_options
        self.total_sms: int | None = host.total_sms

    def run(
        self,
        policy: CoLocationPolicy,
        trace: list[TraceRequest],
        duration_s: float,
        slo_ms: float,
        with_job: bool,
        stop: Callable[[list[IterationRecord]], bool] | None = None,
        drain_s: float = 0.0,
    ) -> tuple[list[IterationRecord], float, float]:
        requests = [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace]
        records = self.host.run(
            policy, requests, duration_s, slo_ms, self.job if with_job else None, drain_s
        )
        end = max((r.timestamp + r.iteration_ms / 1e3 for r in records), default=duration_s)
        return records, 0.0, max(end, duration_s)


Backend = LoopBackend | SimBackend
