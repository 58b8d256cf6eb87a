"""Model runner: weights, KV-cache tensors, request state, and the launch and read-back of each
step. It holds two paths that compute a step's logits: the decode fast path with its static
buffers and CUDA graphs (`DecodePath`, `static_decode.py`) and the general path for flattened
tokens with the mixed-step graphs (`GeneralPath`, `general_step.py`); and the sampling and
read-back of the tokens (`StepReadback`, `step_readback.py`).

It executes one `SchedulerOutput` per call. Its per-request state (tokens, block table row) is
built from the scheduler's full data once, then updated by diffs. Decode-only batches on CUDA go
through the Triton paged-decode kernel, padded to a batch bucket and replayed from a CUDA graph;
everything else (prefill chunks, mixed batches, CPU) takes the general path: `MixedPagedAttention`
(one varlen Triton launch per layer on CUDA) eagerly or from the mixed-step graphs, or, with
`mixed_batch_attention` off (its default without the triton backend, e.g. on CPU), the model's
own forward per sequence with gather + SDPA. The only host sync is the copy of the sampled tokens
at the end of `execute`.

Adapters: with a `LoraRuntime`, a decode step whose batch holds a request with a `lora_name`
runs, on CUDA with the fused kernels, the same fused step plus each row's LoRA terms (the row's
slot is a static input, the stacked slots are fixed tensors), replayed from a second set of
graphs; elsewhere (CPU, no fused kernels) `lora.forward` eagerly over the same buffers. Other
steps with adapters run `lora.forward` on the general path. Steps without adapter requests never
touch the runtime and replay the base graphs.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.cuda_graphs import (
    freeze_long_lived,
    gc_paused_for_capture,
    thaw_engine_freeze,
)
from gpu_runtime.engine.general_step import GeneralPath
from gpu_runtime.engine.kv_cache import KVStorageFactory, PagedKVCache, default_kv_storage
from gpu_runtime.engine.prompt_logprobs import prompt_logprobs, prompt_rows
from gpu_runtime.engine.request_rows import RequestRows
from gpu_runtime.engine.runner_types import (
    ModelRunnerOutput,
    PendingTokens,
    StepHandle,
    _RequestState,
    blas_library,
    gemm_sm_target,
)
from gpu_runtime.engine.sampler import Sampler
from gpu_runtime.engine.scheduler import SchedulerOutput
from gpu_runtime.engine.static_decode import DecodePath
from gpu_runtime.engine.step_readback import StepReadback
from gpu_runtime.engine.tp_sampling import sampler_for
from gpu_runtime.lora.protocol import LoraRuntime
from gpu_runtime.model.llama import CausalLM
from gpu_runtime.model.loader import torch_dtype
from gpu_runtime.structured.outputs import StructuredOutputs

if TYPE_CHECKING:
    from gpu_runtime.engine.fast_decode import FusedDecodeForward as FusedDecodeForwardType

__all__ = ["ModelRunner", "ModelRunnerOutput", "_RequestState", "blas_library"]


class ModelRunner:
    """Runs the model over paged KV storage taken from `kv_storage_factory`."""

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        kv_storage_factory: KVStorageFactory = default_kv_storage,
        lora: LoraRuntime | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        """`lora` must be built over `model`'s own tensors with `max_tokens >=
        config.max_num_batched_tokens` (every token of a step gets a slot); `structured`: the
        grammar matchers whose requests' logits rows are masked before sampling."""
        self.config = config
        self.model = model
        self.lora = lora
        self.device = torch.device(config.device)
        if thaw_engine_freeze():  # an earlier engine froze the heap: free dropped ones first
            gc.collect()
        self.model.fuse_projections()
        weight_dtype = model.model.embed_tokens.weight.dtype
        kv_dtype = torch_dtype(config.kv_dtype) if config.kv_dtype else weight_dtype
        self.kv_cache = PagedKVCache(
            model.local_config,
            config.storage_blocks,
            config.block_size,
            kv_dtype,
            self.device,
            kv_storage_factory,
        )
        self.sampler: Sampler = sampler_for(model.parallel, self.device, config.seed)
        """A plain `Sampler` at TP size 1; under TP rank 0 samples and the others take its
        tokens (`tp_sampling`)."""
        pin = self.device.type == "cuda"
        self.rows = RequestRows(config, lora, pin)
        self.states = self.rows.states
        """Live requests' states by id (`rows.states`)."""
        self.readback = StepReadback(
            self.sampler, self.device, config.max_num_seqs + 1, pin, structured
        )
        """Sampling, copies back and read-back of launched steps; the last launched step."""
        self._num_launched = 0
        self.num_overlapped_steps = 0
        """Steps launched before the previous step was read back (inputs from the device)."""
        self.num_discarded_steps = 0
        """Launched steps never read back (every request they sampled had finished)."""
        self.num_deferred_samplings = 0
        """Steps launched ahead whose sampling was queued later (`sample_deferred`)."""
        self.last_launch_seconds = 0.0
        """Host time of the last `execute` until the model's work is queued (request state,
        input staging and copies, graph replay or eager kernel launches)."""
        self.last_sample_seconds = 0.0
        """Host time of the last `execute` queueing the sampling and the copies back (overlaps
        the device's work on the step)."""
        self.last_wait_seconds = 0.0
        """Time the last `execute` waited for the device (the host sync)."""
        self.use_triton = config.resolved_attention_backend == "triton"
        self._num_sms = 1
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self._num_sms = int(props.multi_processor_count)
        self._blas = config.decode_blas_library if self.device.type == "cuda" else None
        self._decode: DecodePath | None = None
        self.fused: FusedDecodeForwardType | None = None
        """The fused CUDA step both paths run (Triton, fused kernels, static decode on)."""
        mixed_graphs = None
        if config.resolved_static_decode_batches:
            if self.use_triton and config.fused_decode_kernels:
                self.fused = _fused_forward(model, self.kv_cache, config, lora)
                if config.mixed_cuda_graphs and config.resolved_mixed_batch_attention:
                    from gpu_runtime.engine.mixed_graphs import MixedStepGraphs  # needs Triton

                    mixed_graphs = MixedStepGraphs(
                        self.fused,
                        config.mixed_graph_token_sizes(),
                        config.max_num_seqs + 1,
                        pin,
                    )
            self._decode = DecodePath(
                model, self.kv_cache, config, self.rows.table_np, self.fused, lora, self._num_sms
            )
        self.general = GeneralPath(
            model,
            self.kv_cache,
            config,
            self.rows.table_cpu,
            self.fused,
            mixed_graphs,
            lora,
            self._num_sms,
        )

    @property
    def static_decode(self) -> bool:
        """Decode-only steps that fit a bucket take the decode fast path."""
        return self._decode is not None

    @property
    def decode(self) -> DecodePath:
        """The decode fast path; RuntimeError when `static_decode` is off (there is none)."""
        if self._decode is None:
            raise RuntimeError("static decode batches are off: the runner has no decode path")
        return self._decode

    @property
    def max_bucket(self) -> int:
        """Largest decode batch the decode fast path takes (0: no fast path)."""
        return self._decode.max_bucket if self._decode is not None else 0

    # ---- execution --------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, output: SchedulerOutput, partition: Hashable = None) -> ModelRunnerOutput:
        """Run one step; `partition` selects the CUDA graph captured for that SM partition."""
        return self.resolve(self.launch(output, partition))

    @torch.no_grad()
    def launch(
        self, output: SchedulerOutput, partition: Hashable = None, defer_sampling: bool = False
    ) -> StepHandle:
        """Queue one step (model, sampling, copies back) without waiting for the device.

        Sampled states count their new token at once (`UNRESOLVED_TOKEN` stands for it on the
        host). While the last launched step is unresolved, the next may be launched only as a
        bucketed decode-only step: rows whose last token is unresolved take it from that step's
        sampled tensor on the device. `resolve` each handle once, in launch order.

        `defer_sampling`: queue the model only; `sample_deferred` queues the sampling later
        (after the previous step's tokens advanced the grammar matchers whose masks this
        step's sampling needs), before any other step is launched or resolved."""
        started = time.perf_counter()
        self.last_launch_seconds = self.last_sample_seconds = self.last_wait_seconds = 0.0
        self.rows.sync(output)
        if output.block_copies:  # fan-out children's copy-on-write blocks, before any write
            self.kv_cache.copy_blocks(output.block_copies)
        result = ModelRunnerOutput()
        handle = StepHandle(self._num_launched, result)
        self._num_launched += 1
        order = list(output.num_scheduled_tokens.items())
        if not order:
            handle.resolved = True
            return handle
        all_states = self.states
        states = [all_states[rid] for rid in output.num_scheduled_tokens]
        decode_only = all(count == 1 for _, count in order) and all(
            s.num_computed_tokens + 1 == len(s.token_ids) for s in states
        )
        pending = self.readback.pending_inputs(states)
        if pending is not None:
            self.num_overlapped_steps += 1
        lora = self.lora
        with_adapters = lora is not None and any(s.lora_name is not None for s in states)
        with blas_library(self._blas):
            logits, sampled_ids = self._forward(
                order, states, partition, decode_only, with_adapters, result, pending
            )
        forwarded = time.perf_counter()
        for state, (_, count) in zip(states, order, strict=True):
            state.num_computed_tokens += count
        if not sampled_ids:  # nothing to read back (prefill chunks only)
            handle.resolved = True
            self.last_launch_seconds = forwarded - started
            return handle
        if not decode_only:
            states = [self.states[rid] for rid in sampled_ids]
        self.last_launch_seconds = forwarded - started
        if defer_sampling:
            stream = torch.cuda.current_stream() if self.device.type == "cuda" else None
            handle.deferred = (logits, sampled_ids, states, stream)
            return handle
        self.readback.queue(handle, logits, sampled_ids, states)
        self.last_sample_seconds = time.perf_counter() - forwarded
        return handle

    @torch.no_grad()
    def sample_deferred(self, handle: StepHandle) -> None:
        """Queue the sampling (and copies back) of a step launched with `defer_sampling`, on
        the stream its model runs on; no-op for a step without deferred sampling."""
        deferred = handle.deferred
        if deferred is None:
            return
        started = time.perf_counter()
        handle.deferred = None
        logits, sampled_ids, states, stream = deferred
        if stream is None or stream == torch.cuda.current_stream():
            self.readback.queue(handle, logits, sampled_ids, states)
        else:
            with torch.cuda.stream(stream):
                self.readback.queue(handle, logits, sampled_ids, states)
        self.num_deferred_samplings += 1
        self.last_sample_seconds = time.perf_counter() - started

    def resolve(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step (its event: later launches keep running) and write its
        tokens into the states; returns its host results."""
        if not handle.resolved:
            self.last_wait_seconds = self.readback.read_back(handle)
        return handle.result

    def discard(self, handle: StepHandle) -> None:
        """Forget a launched step whose results nobody needs (every request it sampled has
        finished); its states keep `UNRESOLVED_TOKEN` and must be dropped next step. The step
        may still run on the device (see `wait_for_launched`)."""
        handle.resolved = True
        self.num_discarded_steps += 1

    def wait_for_launched(self) -> None:
        """Wait until the device has finished the last launched sampling step, also when it
        was discarded, not resolved: it may still write KV blocks (and read adapter slots) of
        requests that finished meanwhile. No-op when already waited for, or on CPU."""
        self.readback.wait_for_launched()

    def _forward(
        self,
        order: list[tuple[str, int]],
        states: list[_RequestState],
        partition: Hashable,
        decode_only: bool,
        with_adapters: bool,
        result: ModelRunnerOutput,
        pending: PendingTokens | None = None,
    ) -> tuple[torch.Tensor, list[str]]:
        """The step's logits (rows to sample) and the ids sampled, in row order. `pending`:
        decode inputs still on the device (bucketed decode-only steps only)."""
        decode = self._decode
        if decode_only and decode is not None and len(order) <= decode.max_bucket:
            logits, bucket, used_graph = decode.logits(
                states, partition, order if with_adapters else None, pending
            )
            result.used_cuda_graph = used_graph
            result.batch_bucket = bucket
            return logits, [rid for rid, _ in order]
        if pending is not None:
            raise RuntimeError(
                "a step launched before the previous one was resolved must be a bucketed "
                f"decode-only step ({len(order)} rows, decode_only={decode_only})"
            )
        wanted = None if decode_only else prompt_rows(order, self.states)
        if wanted is None:
            return self.general.step_logits(order, self.states, partition, with_adapters)
        logits, sampled_ids = self.general.step_logits(
            order, self.states, partition, with_adapters, wanted.flat_index
        )
        result.prompt_logprobs = prompt_logprobs(logits[len(sampled_ids) :], wanted)
        return logits[: len(sampled_ids)], sampled_ids

    def capture_cuda_graphs(
        self,
        batch_sizes: tuple[int, ...] | None = None,
        partition: Hashable = None,
        stream: torch.cuda.Stream | None = None,
        sm_count: int | None = None,
    ) -> list[int]:
        """Capture the decode step for each bucket (largest first), then the mixed-step graphs;
        returns the decode buckets captured.

        `partition`/`stream` key and place the capture for one SM partition; `sm_count`, the
        SMs that partition's kernels may use, lets its GEMMs plan for them
        (`EngineConfig.partition_gemm_sm_target`). With a LoRA runtime on the fused path, the
        LoRA step is captured too (same buckets, same pool).
        """
        decode = self._decode
        if decode is None or not (self.use_triton and self.config.use_cuda_graphs):
            return []
        sizes = decode.graph_sizes(batch_sizes)
        mixed = self.general.mixed_graphs
        target = sm_count if self.config.partition_gemm_sm_target else None
        with (
            blas_library(self._blas),
            gemm_sm_target(target, self._num_sms),
            gc_paused_for_capture(),  # one collection for all
        ):
            decode.capture(sizes, partition, stream)
            if mixed is not None:
                for tokens in reversed(mixed.buckets):
                    mixed.capture(tokens, partition, stream)
        if self.config.gc_freeze_after_capture:
            freeze_long_lived()  # full collections stop walking the model and engine
        return sizes


def _fused_forward(
    model: CausalLM, kv_cache: PagedKVCache, config: EngineConfig, lora: LoraRuntime | None
) -> FusedDecodeForwardType:
    """The fused CUDA decode step over `model` and `kv_cache` (with the runtime's LoRA groups)."""
    from gpu_runtime.engine.fast_decode import FusedDecodeForward  # needs Triton

    groups = lora.decode_groups() if lora is not None else None
    return FusedDecodeForward(
        model,
        kv_cache,
        config.max_model_len,
        groups,
        fuse_lora_expand=config.lora_expand_in_kernels,
        programmatic_launch_rows=config.decode_programmatic_launch_rows,
    )
