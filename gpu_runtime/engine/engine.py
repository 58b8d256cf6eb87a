"""`Engine`: wires block manager, scheduler, model runner and stop checks; `step()` runs one
iteration. Not thread-safe: one thread owns an engine (the server runs it in a loop thread)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.kv_cache import KVStorageFactory, default_kv_storage
from gpu_runtime.engine.lora import LoraRuntime
from gpu_runtime.engine.model_runner import ModelRunner, ModelRunnerOutput
from gpu_runtime.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from gpu_runtime.engine.runner_types import UNRESOLVED_TOKEN, StepHandle
from gpu_runtime.engine.scheduler import (
    AdapterAdmissionError,
    ContinuousBatchingScheduler,
    Scheduler,
    SchedulerOutput,
)
from gpu_runtime.engine.stopping import StopChecker
from gpu_runtime.model.llama import CausalLM
from gpu_runtime.model.loader import load_model, load_tokenizer

AdapterResolver = Callable[[str], bool]
"""Returns True when an adapter of that name can be served (defaults to `lora.has`)."""


class StepTimes(NamedTuple):
    """Where the last `Engine.step()` spent its wall time (seconds)."""

    schedule: float
    """Scheduler: the step's plan."""
    launch: float
    """Runner until the model's work is queued: request state, input staging, graph replay or
    eager kernel launches (the device is idle until the first kernel is queued)."""
    sample: float
    """Runner queueing the sampling and the copies back (overlaps the device's work)."""
    wait: float
    """Waiting for the device at the one host sync."""
    post: float
    """After the sync: tokens into runner and scheduler state, stop rules, outputs."""


class StepAhead(Protocol):
    """A caller's say over the step that `Engine.step` launches ahead (async scheduling)."""

    def plan(self) -> tuple[Hashable, Any] | None:
        """Called once the next step is known (this step's tokens counted as placeholders,
        before it is scheduled): its `(partition, stream)` (stream None: the current one), or
        None to launch nothing ahead (the next call then runs its step synchronously)."""

    def launched(self) -> None:
        """Called right after the step ahead was launched."""


class UnknownAdapterError(ValueError):
    """A request named an adapter the engine cannot serve."""


class Engine:
    """One model, one KV cache, continuous batching; optionally per-request LoRA adapters.

    With `lora` (e.g. `gpu_runtime.finetune.lora_serving.MultiLoraRuntime` built over `model`
    with `max_tokens >= config.max_num_batched_tokens`), `add_request(..., lora_name=name)`
    serves adapter `name` beside base requests in the same batches. The default scheduler
    admits an adapter request only when the runtime can give it a slot (FCFS otherwise) and
    releases the slot when it finishes, is aborted or preempted.
    """

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        tokenizer: Any | None = None,
        kv_storage_factory: KVStorageFactory = default_kv_storage,
        scheduler_factory: Callable[[EngineConfig, BlockManager], Scheduler] | None = None,
        adapter_resolver: AdapterResolver | None = None,
        lora: LoraRuntime | None = None,
    ) -> None:
        if config.max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} > model max_position_embeddings="
                f"{model.config.max_position_embeddings}"
            )
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, capacity=config.storage_blocks
        )
        self.lora = lora
        if scheduler_factory is not None:
            if lora is not None:
                raise ValueError(
                    "a custom scheduler_factory cannot be combined with lora (the scheduler "
                    "must admit adapter requests through the runtime's slots)"
                )
            self.scheduler: Scheduler = scheduler_factory(config, self.block_manager)
        elif lora is not None:
            runtime = lora

            def admit(request_id: str, name: str) -> bool:
                try:
                    if not runtime.can_admit(name):
                        return False
                    runtime.attach(request_id, name)
                except (KeyError, ValueError) as exc:  # unknown, or does not fit the slots
                    raise AdapterAdmissionError(
                        f"adapter {name!r} cannot be served: {exc}"
                    ) from exc
                return True

            self.scheduler = ContinuousBatchingScheduler(
                config, self.block_manager, admit_adapter=admit, release_adapter=runtime.detach
            )
        else:
            self.scheduler = ContinuousBatchingScheduler(config, self.block_manager)
        self.runner = ModelRunner(model, config, kv_storage_factory, lora=lora)
        eos = list(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.append(int(tokenizer.eos_token_id))
        self.stop_checker = StopChecker(tokenizer, eos, config.max_model_len)
        self.adapter_resolver = adapter_resolver or (lora.has if lora is not None else None)
        self._ids = itertools.count()
        self.last_step_seconds = 0.0
        self.last_step_times = StepTimes(0.0, 0.0, 0.0, 0.0, 0.0)
        self._inflight: tuple[SchedulerOutput, StepHandle] | None = None
        """With async scheduling: the step launched by the last call, read back by the next."""

    @classmethod
    def from_directory(
        cls, directory: str | Path, config: EngineConfig, dtype: str | None = None, **kwargs: Any
    ) -> Engine:
        """Load model and tokenizer from a HF-format directory."""
        model = load_model(directory, device=config.device, dtype=dtype)
        return cls(model, config, tokenizer=load_tokenizer(directory), **kwargs)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_name: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError for prompts that cannot fit and
        `UnknownAdapterError` (a ValueError) for a `lora_name` the engine cannot serve."""
        params = params or SamplingParams()
        if lora_name is not None and not (
            self.lora is not None and self.adapter_resolver and self.adapter_resolver(lora_name)
        ):
            raise UnknownAdapterError(f"adapter {lora_name!r} is not available on this engine")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            token_ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            token_ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(
                f"logprobs={params.logprobs} > max_logprobs={self.config.max_logprobs}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        request_id = request_id or f"req-{next(self._ids)}"
        self.scheduler.add_request(Request(request_id, token_ids, params, lora_name=lora_name))
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is; unknown ids are ignored."""
        self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ---------------------------------------------------------------------------
    def step(
        self,
        partition: Hashable = None,
        on_launched: Callable[[], None] | None = None,
        ahead: StepAhead | None = None,
    ) -> list[RequestOutput]:
        """Schedule, execute, sample, apply stop rules; returns outputs of sampled requests.

        With `config.async_scheduling`, a call may launch the next decode step before it
        reads this one's tokens back (see `EngineConfig.async_scheduling`); each call still
        returns the outputs of one step. The step ahead runs on `partition` unless `ahead`
        chooses its partition and stream, or declines it (`StepAhead`: the co-location loop
        plans the next iteration there, while this step runs on the device). `on_launched`
        is called once this call's step is queued and before the host waits for it (the
        co-location loop launches a finetune quantum there, so its host work overlaps the step
        on the device); not called when the call runs no step."""
        if self.config.async_scheduling:
            return self._step_async(partition, on_launched, ahead)
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        scheduled = time.perf_counter()
        outputs = self._rejected_outputs()
        runner = self.runner
        if plan.is_empty:
            if plan.finished_request_ids:  # nothing to run, but runner state to drop
                runner.execute(plan, partition)
            self._record_times(started, scheduled, 0.0, 0.0, 0.0)
            return outputs
        handle = runner.launch(plan, partition)
        launch, sample = runner.last_launch_seconds, runner.last_sample_seconds
        hook_error = _call_hook(on_launched)
        result = runner.resolve(handle)
        self.scheduler.update_from_output(plan, result.sampled)
        self._sampled_outputs(result, outputs)
        self._record_times(started, scheduled, launch, sample, runner.last_wait_seconds)
        if hook_error is not None:  # the step itself completed: the engine stays consistent
            raise hook_error
        return outputs

    def _rejected_outputs(self) -> list[RequestOutput]:
        return [
            RequestOutput(
                r.request_id,
                [],
                r.output_token_ids,
                "",
                True,
                RequestStatus.FINISHED_ABORTED.value,
                len(r.prompt_token_ids),
                error=str(r.stop_reason),
            )
            for r in self.scheduler.take_rejected()
        ]

    def _sampled_outputs(self, result: ModelRunnerOutput, outputs: list[RequestOutput]) -> None:
        """Stop rules and one output per sampled request still live (tokens already in the
        scheduler's requests)."""
        requests = getattr(self.scheduler, "requests", None)
        get_request, check = self.scheduler.get_request, self.stop_checker.check
        logprobs = result.logprobs
        for request_id, token in result.sampled.items():
            if requests is not None and request_id not in requests:
                continue  # finished or aborted after its step was launched
            request = get_request(request_id)
            text, status, reason = check(request)
            if status is not None:
                self.scheduler.finish_request(request_id, status)
                request.stop_reason = reason
            logprob = logprobs.get(request_id) if logprobs else None
            outputs.append(
                RequestOutput(
                    request_id,
                    [token],
                    request.output_token_ids,
                    text,
                    status is not None,
                    status.value if status is not None else None,
                    len(request.prompt_token_ids),
                    [logprob] if logprob is not None else [],
                )
            )

    def _step_async(
        self,
        partition: Hashable,
        on_launched: Callable[[], None] | None = None,
        ahead: StepAhead | None = None,
    ) -> list[RequestOutput]:
        """One step's outputs; the next decode step is launched before they are read back
        whenever `_can_overlap` allows it and `ahead` does not decline (then it is this
        call's successor's step)."""
        started = time.perf_counter()
        scheduler, runner = self.scheduler, self.runner
        outputs: list[RequestOutput] = []
        launch = sample = 0.0
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            plan = scheduler.schedule()
            outputs += self._rejected_outputs()
            if plan.is_empty:
                if plan.finished_request_ids:
                    runner.execute(plan, partition)
                self._record_times(started, time.perf_counter(), 0.0, 0.0, 0.0)
                return outputs
            handle = runner.launch(plan, partition)
            launch, sample = runner.last_launch_seconds, runner.last_sample_seconds
        else:
            plan, handle = inflight
        scheduled = time.perf_counter() - launch - sample
        hook_error = _call_hook(on_launched)
        following: tuple[SchedulerOutput, StepHandle] | None = None
        overlapped = self._can_overlap(plan, handle)
        if overlapped:
            # count the step's tokens as known (placeholders) and plan the next step on them
            unresolved = dict.fromkeys(handle.sampled_ids, UNRESOLVED_TOKEN)
            scheduler.update_from_output(plan, unresolved)
            target: tuple[Hashable, Any] | None = (partition, None)
            if ahead is not None:
                target, error = _ask_ahead(ahead.plan)
                hook_error = hook_error or error
            if target is not None:
                after = scheduler.schedule()
                outputs += self._rejected_outputs()
                if not after.is_empty:
                    following = (after, self._launch_ahead(after, *target))
                    launch += runner.last_launch_seconds
                    sample += runner.last_sample_seconds
                    if ahead is not None:
                        hook_error = hook_error or _call_hook(ahead.launched)
        result = runner.resolve(handle)
        if overlapped:
            requests = self._requests()
            for request_id, token in result.sampled.items():
                request = requests.get(request_id)
                if request is not None:
                    request.output_token_ids[-1] = token
        else:
            scheduler.update_from_output(plan, result.sampled)
        self._sampled_outputs(result, outputs)
        if following is not None:
            requests = self._requests()
            if any(rid in requests for rid in following[0].num_scheduled_tokens):
                self._inflight = following
            else:  # everyone it computes for has finished
                runner.discard(following[1])
        if self._inflight is None and not scheduler.has_unfinished_requests():
            idle = scheduler.schedule()  # as a synchronous step would: drop runner state now
            if idle.finished_request_ids:
                runner.execute(idle, partition)
        self._record_times(started, scheduled, launch, sample, runner.last_wait_seconds)
        if hook_error is not None:
            raise hook_error
        return outputs

    def _launch_ahead(self, plan: SchedulerOutput, partition: Hashable, stream: Any) -> StepHandle:
        """Launch the step ahead on `stream` (None: the current one), ordered after the
        current stream's work (the step it reads its input tokens from)."""
        if stream is None:
            return self.runner.launch(plan, partition)
        import torch

        current = torch.cuda.current_stream()
        if stream != current:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            return self.runner.launch(plan, partition)

    def _requests(self) -> dict[str, Request]:
        requests: dict[str, Request] = getattr(self.scheduler, "requests", {})
        return requests

    def _can_overlap(self, plan: SchedulerOutput, handle: StepHandle) -> bool:
        """True when the step after `plan` is sure to be a bucketed decode-only step of the
        same requests whatever `plan` samples: every running request was sampled by `plan`,
        none reaches its `max_tokens` or `max_model_len` with that token, no request waits
        (no admission), and free blocks cover every row's next token (no preemption). Stop
        tokens and stop strings are not foreseen: such a request's next step is discarded."""
        scheduler = self.scheduler
        runner = self.runner
        if (
            handle.token_ids is None
            or not isinstance(scheduler, ContinuousBatchingScheduler)
            or scheduler.waiting
            or not runner.static_decode
        ):
            return False
        running = scheduler.running
        scheduled = plan.num_scheduled_tokens
        if not running or len(running) != len(scheduled) or len(running) > runner.max_bucket:
            return False
        block_size = self.block_manager.block_size
        limit = self.config.max_model_len
        needed = 0
        for request in running:
            count = scheduled.get(request.request_id)
            tokens = request.num_tokens
            if count is None or request.num_computed_tokens + count != tokens:
                return False  # not sampled by this step (a chunk of a longer prompt)
            if (
                len(request.output_token_ids) + 1 >= request.sampling_params.max_tokens
                or tokens + 1 >= limit
            ):
                return False  # stops on length with this step's token
            if tokens + 1 > len(request.block_table) * block_size:
                needed += 1
        return self.block_manager.can_allocate(needed)

    def _record_times(
        self, started: float, scheduled: float, launch: float, sample: float, wait: float
    ) -> None:
        now = time.perf_counter()
        self.last_step_seconds = now - started
        post = max(0.0, now - scheduled - launch - sample - wait)
        self.last_step_times = StepTimes(scheduled - started, launch, sample, wait, post)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | None = None,
        lora_names: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (all queued at once); final outputs in prompt order.
        `lora_names[i]` is prompt i's adapter (None: base model)."""
        names = list(lora_names) if lora_names is not None else [None] * len(prompts)
        if len(names) != len(prompts):
            raise ValueError(f"{len(names)} lora_names for {len(prompts)} prompts")
        ids = [
            self.add_request(p, params, lora_name=n) for p, n in zip(prompts, names, strict=True)
        ]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def capture_cuda_graphs(self, **kwargs: Any) -> list[int]:
        """Capture decode graphs (see `ModelRunner.capture_cuda_graphs`)."""
        return self.runner.capture_cuda_graphs(**kwargs)

    # ---- KV capacity (memory pool hand-over) ------------------------------------------------
    def grow_kv_blocks(self, block_ids: list[int]) -> None:
        """Make storage blocks usable again (ids < config.storage_blocks)."""
        self.block_manager.grow(block_ids)

    def shrink_kv_blocks(self, num_blocks: int) -> list[int]:
        """Take up to `num_blocks` free blocks out of use, highest ids first; returns them.
        With async scheduling, first waits for the last launched step if it may still run
        (in flight, or discarded after its requests stopped): it may still write blocks freed
        when a request finished before it was read back."""
        self.runner.wait_for_launched()
        return self.block_manager.shrink(num_blocks)


def _ask_ahead(
    plan: Callable[[], tuple[Hashable, Any] | None],
) -> tuple[tuple[Hashable, Any] | None, Exception | None]:
    """`StepAhead.plan`'s answer; an error declines the step ahead and is raised once this
    call's step has been read back and applied, as `on_launched`'s is."""
    try:
        return plan(), None
    except Exception as exc:
        return None, exc


def _call_hook(hook: Callable[[], None] | None) -> Exception | None:
    """Run `Engine.step`'s `on_launched`; an error is returned, to be raised once the launched
    step has been read back and applied (a step left unresolved would corrupt the next)."""
    if hook is None:
        return None
    try:
        hook()
    except Exception as exc:
        return exc
    return None
