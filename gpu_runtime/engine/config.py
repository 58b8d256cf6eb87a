"""Validated configuration of the decode engine."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineConfigError(ValueError):
    """An engine configuration is invalid; the message names the fields and values."""


@dataclass(frozen=True)
class EngineConfig:
    """Capacity, batching and execution settings of one decode engine."""

    num_kv_blocks: int
    """KV-cache blocks the block manager may hand out at start (adjustable at run time by
    `Engine.grow_kv_blocks` / `Engine.shrink_kv_blocks` within `kv_block_capacity`)."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_block_capacity: int | None = None
    """Blocks the KV storage is created with (>= num_kv_blocks); None means num_kv_blocks.
    Blocks beyond num_kv_blocks are storage the block manager may be given later."""
    max_num_seqs: int = 256
    """Most requests running in one step (decode batch size limit)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens + prefill chunk tokens)."""
    max_model_len: int = 4096
    """Longest sequence (prompt + output) admitted; fixes the block-table width."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps within max_num_batched_tokens; when False a prompt
    longer than the budget is rejected."""
    enable_prefix_caching: bool = True
    """Automatic prefix caching: full KV blocks are kept, named by a digest of their tokens,
    their prefix and the adapter, and a request admitted later starts after the longest
    cached prefix of its prompt (whole blocks; its last token always computed). Freed cached
    blocks are evicted least recently freed first, only when no empty block is left. False:
    every prompt is computed from its first token and freed blocks are empty at once."""
    device: str = "cpu"
    """torch device of weights, KV cache and sampling ("cpu", "cuda", "cuda:1")."""
    kv_dtype: str | None = None
    """KV-cache dtype name; None means the model's dtype."""
    attention_backend: str = "auto"
    """"torch" (gather + SDPA; CPU and reference), "triton" (paged decode kernel, CUDA only) or
    "auto" (triton on CUDA, torch otherwise)."""
    fused_decode_kernels: bool = True
    """On CUDA, run the decode step through fused Triton kernels (RMSNorm, RoPE + cache write,
    SwiGLU); False runs `CausalLM.forward` with the Triton attention only."""
    static_decode_batches: bool | None = None
    """Run decode-only steps over fixed-shape buffers padded to a batch bucket (what CUDA graphs
    replay). None: on with the triton backend; True on CPU runs the same staging with torch
    attention (tests)."""
    mixed_batch_attention: bool | None = None
    """Steps that are not decode-only (prefill chunks beside decode rows) attend with
    `MixedPagedAttention` (decode rows in one batched call per layer, chunks via SDPA) and, on
    CUDA with the fused kernels, run the fused step eagerly; False keeps the per-sequence torch
    loop over the model's own forward. None: on with the triton backend."""
    chunk_attention: str = "varlen"
    """Attention of steps with prefill chunks under `mixed_batch_attention` on CUDA: "varlen"
    (one Triton launch per layer for every token of the step, K/V read from the paged cache;
    `attention/triton_varlen.py`) or "sdpa" (decode rows through the paged-decode kernel, each
    chunk gathered and attended by SDPA: a dozen launches per chunk and layer)."""
    lora_expand_in_kernels: bool = True
    """With adapters on the fused CUDA path, add the q|k|v and gate|up LoRA expand terms inside
    the RoPE and SwiGLU kernels at small batches (fewer kernels) instead of separate expand
    kernels."""
    mixed_cuda_graphs: bool = False
    """On CUDA with the fused kernels, `capture_cuda_graphs` also captures steps that carry
    prefill chunks, piecewise per token bucket (`mixed_graph_token_sizes`): everything between
    two attentions is replayed from a graph, the attention runs eagerly. Such steps without
    adapters then replay them; off, they launch every kernel from Python."""
    gc_freeze_after_capture: bool = True
    """After `capture_cuda_graphs` captured anything, move every live Python object into the
    cyclic collector's permanent generation (`cuda_graphs.freeze_long_lived`), so automatic
    full collections stop walking the model, engine and imported modules (a few hundred ms
    inside a step otherwise; see `cuda_graphs.py`). The next capture and the next runner built
    unfreeze first and collect, so a dropped engine is still freed then (not by a plain
    `gc.collect()` in between). False leaves the collector as it is."""
    decode_blas_library: str | None = None
    """BLAS library of the model's GEMMs on CUDA ("cublas", "cublaslt"; None: torch's current
    choice), set while decode graphs are captured (graphs keep the kernels chosen then) and
    around eager steps, restored afterwards."""
    partition_gemm_sm_target: bool = True
    """Decode and mixed-step graphs captured for an SM partition
    (`capture_cuda_graphs(sm_count=n)`, n below the device's SMs) plan their GEMMs for n SMs:
    cuBLASLt with an SM-count target during the capture (`runner_types.gemm_sm_target`); graphs
    captured for the whole device are untouched (why on for decode graphs:
    docs/decisions/0019-partition-gemm-sm-target.md). False: the library's own choice on every
    partition."""
    decode_programmatic_launch_rows: int = 32
    """On CUDA with the fused kernels, decode steps of at most this many rows launch their
    Triton kernels (norms, RoPE, attention, SwiGLU) as programmatic dependents (Hopper's
    programmatic dependent launch): each may be scheduled while the kernel before it finishes,
    and waits for it on the device before reading its output (`fused_ops`). 0: never. 32: it
    helps small batches and slows large ones
    (docs/decisions/0006-programmatic-dependent-launch.md). Read when a graph is captured or an
    eager step runs."""
    async_scheduling: bool = False
    """`Engine.step()` launches the next decode step before reading the current one's sampled
    tokens (its inputs are gathered on the device), so scheduling, staging, stop rules and
    outputs overlap the device's work. Only when the next step is sure to be a bucketed
    decode-only step over the same requests (no waiting requests, nobody reaching
    `max_tokens`, blocks free for every row); other steps run as before. A request that
    stops on a token gets one extra (discarded) decode step. A request added while a step is
    in flight is admitted one call later (one step of TTFT), and the rows of that call then
    run in a decode graph instead of beside the new prompt (bf16-rounding differences on
    CUDA); with the same steps, tokens and logprobs are those of the synchronous engine.
    Blocks freed at a step's end may still be written by the step launched after it (stream
    order), so a memory pool must synchronize the stream before unmapping them. Off by
    default: a caller that times `step()`, or changes `partition` (stream, SM split) from one
    call to the next, sees the step launched by the previous call unless it chooses the step
    ahead's partition itself (`Engine.step`'s `ahead`, as the co-location loop does)."""
    use_cuda_graphs: bool = True
    """Capture the decode step per batch bucket (CUDA only; ignored on CPU)."""
    cuda_graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES
    """Batch buckets captured; a decode batch is padded up to the smallest bucket that fits."""
    seed: int = 0
    """Seed of the sampler's generator for requests without their own seed."""
    max_logprobs: int = 20
    """Most top logprobs a request may ask for."""
    extra: dict[str, str] = field(default_factory=dict, compare=False)
    """Free-form labels carried into metrics (e.g. deployment name)."""

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"{name}={value!r} must be a positive integer")
        if self.block_size & (self.block_size - 1):
            raise EngineConfigError(f"block_size={self.block_size} must be a power of two")
        capacity = self.kv_block_capacity
        if capacity is not None and capacity < self.num_kv_blocks:
            raise EngineConfigError(
                f"kv_block_capacity={capacity} < num_kv_blocks={self.num_kv_blocks}"
            )
        if self.max_model_len < 2:
            raise EngineConfigError(f"max_model_len={self.max_model_len} must be >= 2")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < "
                f"max_num_seqs={self.max_num_seqs}: a full decode batch would not fit"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise EngineConfigError(
                f"without chunked prefill max_num_batched_tokens={self.max_num_batched_tokens} "
                f"must be >= max_model_len={self.max_model_len}"
            )
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise EngineConfigError(
                f"attention_backend={self.attention_backend!r} not in auto, torch, triton"
            )
        if self.attention_backend == "triton" and not self.device.startswith("cuda"):
            raise EngineConfigError(f"attention_backend='triton' needs CUDA, device={self.device}")
        if self.chunk_attention not in ("varlen", "sdpa"):
            raise EngineConfigError(f"chunk_attention={self.chunk_attention!r} not in varlen, sdpa")
        if self.decode_blas_library not in (None, "cublas", "cublaslt"):
            raise EngineConfigError(
                f"decode_blas_library={self.decode_blas_library!r} not in None, cublas, cublaslt"
            )
        sizes = self.cuda_graph_batch_sizes
        if any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
            raise EngineConfigError(
                f"cuda_graph_batch_sizes={sizes} must be increasing positive integers"
            )
        rows = self.decode_programmatic_launch_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise EngineConfigError(
                f"decode_programmatic_launch_rows={rows!r} must be an integer >= 0"
            )
        if not 0 <= self.max_logprobs <= 100:
            raise EngineConfigError(f"max_logprobs={self.max_logprobs} must be in [0, 100]")

    @property
    def storage_blocks(self) -> int:
        """Blocks the KV storage holds for requests (excludes the runner's padding block)."""
        return self.kv_block_capacity or self.num_kv_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block table."""
        return -(-self.max_model_len // self.block_size)

    @property
    def is_cuda(self) -> bool:
        """True when the engine runs on a CUDA device."""
        return self.device.startswith("cuda")

    @property
    def resolved_attention_backend(self) -> str:
        """ "triton" or "torch" after resolving "auto"."""
        if self.attention_backend == "auto":
            return "triton" if self.is_cuda else "torch"
        return self.attention_backend

    @property
    def resolved_static_decode_batches(self) -> bool:
        """`static_decode_batches` after resolving None."""
        if self.static_decode_batches is None:
            return self.resolved_attention_backend == "triton"
        return self.static_decode_batches

    @property
    def resolved_mixed_batch_attention(self) -> bool:
        """`mixed_batch_attention` after resolving None."""
        if self.mixed_batch_attention is None:
            return self.resolved_attention_backend == "triton"
        return self.mixed_batch_attention

    def mixed_graph_token_sizes(self) -> tuple[int, ...]:
        """Token buckets of the mixed-step graphs: 64, 128, 256, then every 256 below the
        step's token budget, then the budget (padding past 256 tokens costs GEMM time: such
        steps are compute-bound)."""
        budget = self.max_num_batched_tokens
        sizes = [s for s in (64, 128, 256) if s < budget]
        size = 512
        while size < budget:
            sizes.append(size)
            size += 256
        return (*sizes, budget)

    def graph_batch_sizes(self) -> tuple[int, ...]:
        """Buckets actually captured: those <= max_num_seqs, plus max_num_seqs when larger."""
        sizes = [s for s in self.cuda_graph_batch_sizes if s <= self.max_num_seqs]
        if not sizes or sizes[-1] < self.max_num_seqs:
            sizes.append(self.max_num_seqs)
        return tuple(sizes)
