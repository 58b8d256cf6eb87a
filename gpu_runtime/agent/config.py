"""The host agent's settings (command line and environment; validated)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_runtime.agent.outbox import DEFAULT_MAX_BYTES, DEFAULT_MAX_MESSAGES
from gpu_runtime.contract.hparams import DEFAULT_LORA_MAX_RANK

if TYPE_CHECKING:
    from gpu_runtime.server.limits import RequestLimits

DEFAULT_DECODE_GROUPS = (6, 8, 12)
"""Decode SMs in units of 8 (48, 64 and 96 on Hopper), besides the whole device: with these
splits harli keeps its TPOT attainment on every trace for both models; a 32-SM split as well
does not (docs/decisions/0013-quantum-sizing-and-splits.md)."""

GIB = 2**30
OUTBOX_DIR_ENV = "HARLI_OUTBOX_DIR"
HOST_KEY_ENV = "HARLI_HOST_KEY"
ADMIN_TOKEN_ENV = "HARLI_HOST_ADMIN_TOKEN"
"""The operator token of the host's adapter routes (the same variable as the stand-alone
server's, `gpu_runtime.server.adapter_admin`; repeated: this module must not load torch)."""
_HOST_KEY = re.compile(r"[0-9a-f]{64}")
ENGINES = ("harli", "vllm")
VLLM_ENV = "HARLI_VLLM"
"""The vLLM executable of an `--engine vllm` host (`--vllm-bin` wins)."""


@dataclass(frozen=True)
class HostCapabilities:
    """What a host can do, by its engine: whether it co-locates finetuning with decode, the
    model architectures it serves (empty: whatever its engine loads), and its adapter limits.
    The heartbeat reports them (`gpu_runtime.contract.host_capabilities`)."""

    engine: str
    colocation: bool
    architectures: tuple[str, ...]
    max_loras: int
    max_lora_rank: int

    def as_dict(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "colocation": self.colocation,
            "architectures": list(self.architectures),
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
        }


class AgentConfigError(ValueError):
    """A setting out of range or missing; the message names it and its value."""


@dataclass(frozen=True)
class AgentConfig:
    """Everything one agent process needs. Times in seconds."""

    host: str
    """Host name as registered in the control plane; the agent consumes `host.<host>`."""
    broker_url: str
    """Celery broker shared with the control plane (`redis://`, `amqp://`, `filesystem://`)."""
    storage: str
    """Storage location shared with the control plane (`contract.storage.open_storage`)."""
    work_dir: Path
    """Scratch directory for downloaded files, checkpoints and adapters of this host."""
    base_model: str
    """Name of the base model this host serves (the control plane's BaseModel.name)."""
    model_dir: Path | None = None
    """HF-format model directory; None builds the tiny built-in model into `work_dir`."""
    device: str = "cpu"
    """torch device for the engine and training."""
    dtype: str | None = None
    """Weights dtype (None: the checkpoint's)."""
    control_url: str = "http://127.0.0.1:8000"
    """The control plane's base URL, for checking tenants' API keys (`allow_tenant_keys`)."""
    host_key: str | None = field(default=None, repr=False)
    """This host's grant key, hex as `gpu_runtime.contract.grants.host_key` gives it (`manage.py
    hosts key NAME`): the server accepts a request carrying a grant the gateway signed with it.
    None: every grant is refused."""
    metrics_token: str | None = field(default=None, repr=False)
    """Bearer token a Prometheus scrape of the server's `GET /metrics` must carry (the
    environment's HARLI_METRICS_TOKEN; never an option, so never on a command line). None: the
    route is off (404)."""
    admin_token: str | None = field(default=None, repr=False)
    """Bearer token of the operator's adapter routes (`POST /v1/load_lora_adapter`,
    `/v1/unload_lora_adapter`): the environment's HARLI_HOST_ADMIN_TOKEN, never an option.
    None: the routes are off (404). Needs `adapter_roots`."""
    adapter_roots: tuple[Path, ...] = ()
    """Directories the operator's `/v1/load_lora_adapter` may load adapters from
    (`--adapter-root`, repeatable; absolute after parsing); set with `admin_token` or not at
    all."""
    allow_tenant_keys: bool = False
    """Also accept a request without a grant by its tenant's API key, checked against the
    control plane (how hosts took requests before the gateway)."""
    server_host: str = "127.0.0.1"
    server_port: int = 8100
    """Where the OpenAI-compatible inference server listens (0: any free port)."""
    advertise_url: str | None = None
    """URL reported to the control plane for the server (default http://host:port)."""
    max_prompts_per_request: int = 256
    """Most prompts one completion request may carry (`gpu_runtime.server.limits.RequestLimits`,
    whose defaults these repeat: that module loads the engine and torch, this one must not)."""
    max_request_prompt_tokens: int | None = None
    """Most prompt tokens one request may carry in all; None: 32 x the engine's
    `max_model_len` (`RequestLimits`)."""
    heartbeat_s: float = 2.0
    metrics_interval_s: float = 5.0
    key_cache_ttl_s: float = 10.0
    """A revoked API key stops working on this host at most this long after revocation."""
    tpot_slo_ms: float = 50.0
    ttft_slo_ms: float | None = None
    """The deployment's TTFT SLO: harli's idle time slices (a quantum alone on the device while
    decode is idle, which a new request waits for) take at most half of it. None: no cap but the
    quantum's."""
    policy: str = "harli"
    """Co-location policy ("harli" falls back to "naive" without a latency predictor)."""
    memory_bytes: int = 16 * GIB
    """Memory the host reports as its total on CPU (on CUDA the device's total is used)."""
    num_kv_blocks: int = 256
    block_size: int = 16
    max_model_len: int = 512
    max_num_seqs: int = 64
    """Requests decoding at once (the largest decode batch)."""
    max_num_batched_tokens: int = 512
    """Token budget of one engine step (decode rows plus prefill chunk tokens): longer prompts
    are prefilled in chunks, so a step carrying one stays short beside decode."""
    mixed_cuda_graphs: bool = True
    """CUDA: also replay steps carrying prefill chunks from graphs captured per token bucket
    and split (`EngineConfig.mixed_cuda_graphs`); such steps otherwise launch every kernel
    from Python and cost decode several times more."""
    lora_slots: int = 8
    """Adapters resident on the device at once (more are served, swapped in LRU order)."""
    lora_max_rank: int = DEFAULT_LORA_MAX_RANK
    """Largest adapter rank served; a job trained with a larger rank cannot be called here."""
    memory_pool: bool | None = None
    """Unified KV/finetune memory pool: None = on CUDA devices only."""
    memory_pool_bytes: int | None = None
    """The pool's size; required for a pool on CPU, on CUDA None = free memory less 4 GiB."""
    decode_groups: tuple[int, ...] | None = DEFAULT_DECODE_GROUPS
    """CUDA: decode SM splits (units of the SM granularity) besides the whole device; None:
    every split."""
    tensor_parallel_size: int = 1
    """The engine's tensor-parallel degree T: above 1, an engine group on devices 0..T-1 of
    `device` (CPU: T gloo ranks), with no unified memory pool."""
    predictor_path: Path | None = None
    """Latency predictor artifact (directory or root); None: no predictor."""
    broker_dir: Path | None = None
    """Folder of the `filesystem://` transport (shared with the control plane)."""
    outbox_dir: Path | None = None
    """The durable outbox of reports not yet confirmed by the broker (`agent.outbox`), on
    local persistent disk, one per host; None: `work_dir`/outbox. A restarted agent sends what
    it holds first."""
    outbox_max_reports: int = DEFAULT_MAX_MESSAGES
    """Reports the outbox holds before it refuses progress and metrics reports (job lifecycle
    reports are kept past it)."""
    outbox_max_bytes: int = DEFAULT_MAX_BYTES
    """Bytes the outbox holds before it refuses progress and metrics reports."""
    engine: str = "harli"
    """"harli" (the co-locating engine of this repository) or "vllm" (a vLLM OpenAI server
    the agent supervises, `gpu_runtime.agent.vllm`: serving and adapters, no finetuning)."""
    vllm_bin: Path | None = None
    """vLLM's executable for `engine` "vllm": `<venv>/bin/python` (run as `-m
    vllm.entrypoints.openai.api_server`) or a `vllm` script (run as `vllm serve`)."""
    vllm_port: int = 0
    """vLLM's loopback port (0: a free one)."""
    vllm_ready_timeout_s: float = 600.0
    """How long vLLM may take to answer `/health` after a start."""
    vllm_args: tuple[str, ...] = ()
    """More arguments for vLLM's server (`--vllm-arg`, repeatable: `--tensor-parallel-size 2`,
    `--gpu-memory-utilization 0.85`, `--enforce-eager`)."""

    def __post_init__(self) -> None:
        checks = [
            (bool(self.host), "host must be non-empty"),
            (bool(self.broker_url), "broker_url must be set (--broker or CELERY_BROKER_URL)"),
            (bool(self.base_model), "base_model must be non-empty"),
            (self.heartbeat_s > 0, f"heartbeat_s must be > 0, got {self.heartbeat_s}"),
            (
                self.metrics_interval_s > 0,
                f"metrics_interval_s must be > 0, got {self.metrics_interval_s}",
            ),
            (
                self.key_cache_ttl_s >= 0,
                f"key_cache_ttl_s must be >= 0, got {self.key_cache_ttl_s}",
            ),
            (self.tpot_slo_ms > 0, f"tpot_slo_ms must be > 0, got {self.tpot_slo_ms}"),
            (
                self.host_key is None or _HOST_KEY.fullmatch(self.host_key) is not None,
                "the host key must be the 64 hex characters `manage.py hosts key NAME` prints "
                f"(--host-key-file or {HOST_KEY_ENV})",
            ),
            (
                self.ttft_slo_ms is None or self.ttft_slo_ms > 0,
                f"ttft_slo_ms must be > 0, got {self.ttft_slo_ms}",
            ),
            (0 <= self.server_port < 65536, f"server_port out of range: {self.server_port}"),
            (
                self.max_prompts_per_request >= 1,
                f"max_prompts_per_request must be >= 1, got {self.max_prompts_per_request}",
            ),
            (
                self.max_request_prompt_tokens is None or self.max_request_prompt_tokens >= 1,
                f"max_request_prompt_tokens must be >= 1, got {self.max_request_prompt_tokens}",
            ),
            (self.memory_bytes > 0, f"memory_bytes must be > 0, got {self.memory_bytes}"),
            (self.lora_slots >= 1, f"lora_slots must be >= 1, got {self.lora_slots}"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (
                self.max_num_batched_tokens >= self.max_num_seqs,
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every decoding request needs a token "
                "of each step",
            ),
            (
                self.outbox_max_reports >= 1,
                f"outbox_max_reports must be >= 1, got {self.outbox_max_reports}",
            ),
            (
                self.outbox_max_bytes >= 1,
                f"outbox_max_bytes must be >= 1, got {self.outbox_max_bytes}",
            ),
            (self.lora_max_rank >= 1, f"lora_max_rank must be >= 1, got {self.lora_max_rank}"),
            (
                not (self.memory_pool and self.device == "cpu" and not self.memory_pool_bytes),
                "a memory pool on the CPU needs its size (--memory-pool-gb)",
            ),
            (
                self.tensor_parallel_size >= 1,
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}",
            ),
            (
                not (self.memory_pool and self.tensor_parallel_size > 1),
                "--memory-pool on needs --tensor-parallel-size 1: the unified pool's KV "
                "grow/shrink and finetune lending are not mirrored to an engine group's "
                f"followers (got --tensor-parallel-size {self.tensor_parallel_size}; use "
                "--memory-pool auto or off)",
            ),
            (
                not (self.engine == "vllm" and self.tensor_parallel_size > 1),
                "--engine vllm takes its degree from --vllm-arg '--tensor-parallel-size N', "
                "not the agent's --tensor-parallel-size",
            ),
            (
                not self.broker_url.startswith("filesystem://") or self.broker_dir is not None,
                "a filesystem:// broker needs broker_dir (--broker-dir or HARLI_BROKER_DIR)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise AgentConfigError(message)
        if bool(self.admin_token) != bool(self.adapter_roots):
            roots = [str(r) for r in self.adapter_roots]
            token = "set" if self.admin_token else "unset"
            raise AgentConfigError(
                f"{ADMIN_TOKEN_ENV} and --adapter-root go together: token {token}, roots {roots}"
            )
        for root in self.adapter_roots:
            if not Path(root).is_absolute() or not Path(root).is_dir():
                raise AgentConfigError(f"adapter root {str(root)!r} is not an absolute directory")
        if self.engine not in ENGINES:
            raise AgentConfigError(f"engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.engine == "vllm":
            self._check_vllm()
        if self.model_dir is not None and not (Path(self.model_dir) / "config.json").is_file():
            raise AgentConfigError(f"model_dir {self.model_dir} has no config.json")

    def _check_vllm(self) -> None:
        if self.model_dir is None:
            raise AgentConfigError("--engine vllm needs --model-dir (vLLM has no built-in model)")
        if self.vllm_bin is None or not Path(self.vllm_bin).is_file():
            raise AgentConfigError(
                f"--engine vllm needs vLLM's executable: --vllm-bin or {VLLM_ENV} (got "
                f"{self.vllm_bin}; scripts/vllm_env.sh installs one in .venv-vllm)"
            )
        self.vllm_tensor_parallel_size()  # a bad --tensor-parallel-size is refused here
        if not 0 <= self.vllm_port < 65536:
            raise AgentConfigError(f"vllm_port out of range: {self.vllm_port}")
        if self.vllm_ready_timeout_s <= 0:
            raise AgentConfigError(
                f"vllm_ready_timeout_s must be > 0, got {self.vllm_ready_timeout_s}"
            )

    def vllm_tensor_parallel_size(self) -> int:
        """The GPUs vLLM shards the model over: `--tensor-parallel-size N` (or `-tp N`) among
        `vllm_args`, else 1."""
        args = list(self.vllm_args)
        for i, arg in enumerate(args):
            name, _, value = arg.partition("=")
            if name in ("--tensor-parallel-size", "-tp"):
                text = value or (args[i + 1] if i + 1 < len(args) else "")
                if not text.isdigit() or int(text) < 1:
                    raise AgentConfigError(f"{name} needs a positive integer, got {text!r}")
                return int(text)
        return 1

    def capabilities(self, architectures: tuple[str, ...] = ()) -> HostCapabilities:
        """This host's capabilities (`architectures`: the model directory's)."""
        return HostCapabilities(
            engine=self.engine,
            colocation=self.engine == "harli",
            architectures=architectures,
            max_loras=self.lora_slots,
            max_lora_rank=self.lora_max_rank,
        )

    def outbox_path(self) -> Path:
        """Where the outbox lives (`outbox_dir`, else under `work_dir`)."""
        return self.outbox_dir if self.outbox_dir is not None else self.work_dir / "outbox"

    def request_limits(self) -> RequestLimits:
        """The inference server's per-request limits (imports the server, hence torch)."""
        from gpu_runtime.server.limits import RequestLimits

        return RequestLimits(self.max_prompts_per_request, self.max_request_prompt_tokens)


def env_broker_url() -> str:
    return os.environ.get("HARLI_BROKER_URL") or os.environ.get("CELERY_BROKER_URL", "")
