"""`Engine`: wires block manager, scheduler, model runner and stop checks; `step()` runs one
iteration. Not thread-safe: one thread owns an engine (the server runs it in a loop thread)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.distributed.control import DriverChannel
from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.continuous_batching import ContinuousBatchingScheduler
from gpu_runtime.engine.fanout import sequence_ids
from gpu_runtime.engine.kv_cache import KVStorageFactory, default_kv_storage
from gpu_runtime.engine.overlap import OverlappedSteps
from gpu_runtime.engine.request import Request, RequestOutput, SamplingParams
from gpu_runtime.engine.scheduler import AdapterAdmissionError, Scheduler
from gpu_runtime.engine.step_outputs import StepOutputs
from gpu_runtime.engine.step_types import StepAhead, StepClock, StepTimes, call_hook
from gpu_runtime.engine.stopping import StopChecker
from gpu_runtime.engine.tp_runner import check_engine_parallel, runner_for
from gpu_runtime.lora.protocol import LoraRuntime
from gpu_runtime.model.llama import CausalLM
from gpu_runtime.model.loader import load_model, load_tokenizer
from gpu_runtime.structured.outputs import StructuredOutputs

AdapterResolver = Callable[[str], bool]
"""Returns True when an adapter of that name can be served (defaults to `lora.has`)."""


class UnknownAdapterError(ValueError):
    """A request named an adapter the engine cannot serve."""


class Engine:
    """One model, one KV cache, continuous batching; optionally per-request LoRA adapters.

    With `lora` (e.g. `gpu_runtime.lora.runtime.MultiLoraRuntime` built over `model`
    with `max_tokens >= config.max_num_batched_tokens`), `add_request(..., lora_name=name)`
    serves adapter `name` beside base requests in the same batches. The scheduler admits an
    adapter request only when the runtime can give it a slot (FCFS otherwise) and releases the
    slot when it finishes, is aborted or preempted.

    Roles: `scheduler` (a `Scheduler`: the plan of each step; other parts read it through its
    contract), `runner` (a `ModelRunner`: launch and read-back of a plan), `outputs` (stop rules,
    `RequestOutput`s), `overlap` (async scheduling), `clock` (the last step's times).
    """

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        tokenizer: Any | None = None,
        kv_storage_factory: KVStorageFactory = default_kv_storage,
        adapter_resolver: AdapterResolver | None = None,
        lora: LoraRuntime | None = None,
        control: DriverChannel | None = None,
    ) -> None:
        """`control`: under tensor parallelism (`model` is rank 0's shard of a group of two or
        more), the channel to the followers (`engine_group.start_engine_group` builds both);
        the runner then mirrors its calls to them (`tp_runner.MirroredRunner`)."""
        check_engine_parallel(model, control, lora)
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
        self.scheduler: Scheduler = _scheduler(config, self.block_manager, lora)
        eos = list(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.append(int(tokenizer.eos_token_id))
        self.structured = StructuredOutputs(
            tokenizer,
            model.config.vocab_size,
            eos,
            config.max_num_seqs + 1,
            torch.device(config.device),
        )
        """Grammar matchers of constrained requests (`SamplingParams.structured_output`);
        `structured.compiler` compiles a request's grammar ahead, from any thread."""
        self.runner = runner_for(model, config, kv_storage_factory, lora, self.structured, control)
        self.stop_checker = StopChecker(tokenizer, eos, config.max_model_len)
        vocab = model.config.vocab_size  # an eos id past the logits could not be masked
        self.runner.sampler.eos_token_ids = tuple(sorted(t for t in set(eos) if 0 <= t < vocab))
        self.adapter_resolver = adapter_resolver or (lora.has if lora is not None else None)
        self._ids = itertools.count()
        self.outputs = StepOutputs(self.scheduler, self.stop_checker, self.structured)
        self.clock = StepClock()
        self.overlap = OverlappedSteps(
            self.scheduler, self.runner, self.outputs, self.clock, self.structured
        )
        """Async scheduling (`config.async_scheduling`, read at each step)."""

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
        tenant: str = "",
    ) -> str:
        """Queue a request; returns its id. `tenant` names who asked: waiting requests are
        admitted round-robin across tenants, FIFO within one (`Request.tenant`). Raises
        ValueError for prompts that cannot fit, for token ids of `params` outside the
        vocabulary (`SamplingParams.check_vocab`), `UnknownAdapterError` (a ValueError) for a
        `lora_name` the engine cannot serve and `StructuredOutputError` (a ValueError) for a
        `structured_output` that cannot be compiled (compiled here unless
        `structured.compiler.compile` compiled it before).

        With `params.n > 1` the prompt is prefilled once and forked into n children sharing
        its KV blocks (`fanout.py`); their outputs carry `parent_id` (the returned id) and
        `index`, and `abort_request(id)` aborts them all."""
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
        params.check_vocab(vocab)
        asked = (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs))
        for name, count in asked:
            if count is not None and count > self.config.max_logprobs:
                raise ValueError(f"{name}={count} > max_logprobs={self.config.max_logprobs}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        request_id = request_id or f"req-{next(self._ids)}"
        sequences = sequence_ids(request_id, params.n)  # what samples: the children, if any
        if params.structured_output is not None:
            for sequence in sequences:
                self.structured.admit(sequence, params.structured_output)
        request = Request(
            request_id, token_ids, params, lora_name=lora_name, tenant=tenant, fan_out=params.n
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first token has no logprob
        try:
            self.scheduler.add_request(request)
        except BaseException:
            for sequence in sequences:
                self.structured.release(sequence)
            raise
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is (a fan-out's id: every child); unknown ids are
        ignored."""
        live = self.scheduler.requests.values()
        sequences = [request_id, *(r.request_id for r in live if r.parent_id == request_id)]
        request = self.scheduler.get_request(request_id)
        if request is not None:  # a parent not forked yet: its children's matchers
            sequences += sequence_ids(request_id, request.fan_out)
        self.scheduler.abort_request(request_id)
        for sequence in sequences:
            self.structured.release(sequence)

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
        reads this one's tokens back (`OverlappedSteps`); each call still returns the outputs
        of one step. The step ahead runs on `partition` unless `ahead` chooses its partition
        and stream, or declines it (`StepAhead`: the co-location loop plans the next
        iteration there, while this step runs on the device). `on_launched` is called once
        this call's step is queued and before the host waits for it (the co-location loop
        launches a finetune quantum there, so its host work overlaps the step on the device);
        not called when the call runs no step."""
        if self.config.async_scheduling:
            return self.overlap.step(partition, on_launched, ahead)
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        scheduled = time.perf_counter()
        outputs = self.outputs.rejected()
        runner = self.runner
        if plan.is_empty:
            if plan.finished_request_ids:  # nothing to run, but runner state to drop
                runner.execute(plan, partition)
            self.clock.record(started, scheduled, 0.0, 0.0, 0.0)
            return outputs
        handle = runner.launch(plan, partition)
        launch, sample = runner.last_launch_seconds, runner.last_sample_seconds
        hook_error = call_hook(on_launched)
        result = runner.resolve(handle)
        self.outputs.record_prompt_logprobs(result)
        self.scheduler.update_from_output(plan, result.sampled)
        self.outputs.sampled(result, outputs)
        self.clock.record(started, scheduled, launch, sample, runner.last_wait_seconds)
        if hook_error is not None:  # the step itself completed: the engine stays consistent
            raise hook_error
        return outputs

    @property
    def last_step_seconds(self) -> float:
        """Wall time of the last `step()`."""
        return self.clock.last_step_seconds

    @property
    def last_step_times(self) -> StepTimes:
        """Where the last `step()` spent its wall time."""
        return self.clock.last_step_times

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | None = None,
        lora_names: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (all queued at once); final outputs in prompt order
        (with `params.n > 1`, prompt-major: prompt i's sequence j at `i * n + j`).
        `lora_names[i]` is prompt i's adapter (None: base model)."""
        names = list(lora_names) if lora_names is not None else [None] * len(prompts)
        if len(names) != len(prompts):
            raise ValueError(f"{len(names)} lora_names for {len(prompts)} prompts")
        ids = [
            self.add_request(p, params, lora_name=n) for p, n in zip(prompts, names, strict=True)
        ]
        final: dict[tuple[str, int], RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[(out.parent_id or out.request_id, out.index)] = out
        n = params.n if params is not None else 1
        return [final[(i, j)] for i in ids for j in range(n)]

    def capture_cuda_graphs(self, **kwargs: Any) -> list[int]:
        """Capture decode graphs (see `ModelRunner.capture_cuda_graphs`)."""
        return self.runner.capture_cuda_graphs(**kwargs)

    # ---- KV capacity (memory pool hand-over) ------------------------------------------------
    def grow_kv_blocks(self, block_ids: list[int]) -> None:
        """Make storage blocks usable again (ids < config.storage_blocks)."""
        self.block_manager.grow(block_ids)

    def shrink_kv_blocks(self, num_blocks: int) -> list[int]:
        """Take up to `num_blocks` free blocks out of use: prefix-cached free blocks first (least
        recently freed first, their cache entries dropped), then empty ones, highest ids first;
        returns them. Used blocks are never taken.
        With async scheduling, first waits for the last launched step if it may still run
        (in flight, or discarded after its requests stopped): it may still write blocks freed
        when a request finished before it was read back."""
        self.runner.wait_for_launched()
        return self.block_manager.shrink(num_blocks)


def _scheduler(
    config: EngineConfig, block_manager: BlockManager, lora: LoraRuntime | None
) -> ContinuousBatchingScheduler:
    """The continuous-batching scheduler; with `lora`, it admits an adapter request only when
    the runtime gives it a slot, and drops one the runtime can never serve."""
    if lora is None:
        return ContinuousBatchingScheduler(config, block_manager)
    runtime = lora

    def admissible(request_id: str, name: str) -> bool:
        try:
            return runtime.can_admit(name)
        except (KeyError, ValueError) as exc:  # unknown adapter
            raise AdapterAdmissionError(f"adapter {name!r} cannot be served: {exc}") from exc

    def admit(request_id: str, name: str) -> bool:
        try:
            if not runtime.can_admit(name):
                return False
            runtime.attach(request_id, name)
        except (KeyError, ValueError) as exc:  # unknown, or does not fit the slots
            raise AdapterAdmissionError(f"adapter {name!r} cannot be served: {exc}") from exc
        return True

    return ContinuousBatchingScheduler(
        config,
        block_manager,
        admit_adapter=admit,
        release_adapter=runtime.detach,
        adapter_admissible=admissible,
    )
