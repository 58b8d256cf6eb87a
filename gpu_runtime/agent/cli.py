"""`python -m gpu_runtime.agent --host NAME ...`: one host agent process.

Starts, in this order: the report sender (control queue; what the durable outbox under
`--outbox-dir` holds from a previous run is sent first), the engine loop thread (one engine per
base model with its LoRA runtime for adapters, driven by `HostRuntime`: `HostLoop` decode
iterations and finetune quanta), the OpenAI-compatible server of `gpu_runtime.server` over that
loop (streaming, usage, `/v1/models`; requests accepted by the gateway's grant, verified with the
host key from `--host-key-file` or HARLI_HOST_KEY, and by tenants' keys checked against the
control plane only with `--allow-tenant-keys`: `host_auth`; `GET /metrics` for a Prometheus
scrape bearing HARLI_METRICS_TOKEN, off without it; the operator's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` for a request bearing HARLI_HOST_ADMIN_TOKEN, loading from the
`--adapter-root` directories, off without it), the host-queue consumer; then
sends heartbeats from the main thread until SIGTERM or SIGINT, and stops everything in reverse
order. Exits with status 3 (HOST_QUEUE_LOST_EXIT) if the host-queue consumer gave up
(`channel.CommandConsumer`).
Without `--model-dir` it builds the tiny built-in model (random weights, seed 0) under
`--work-dir`, so every agent started that way serves identical weights.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from gpu_runtime.agent.config import (
    ADMIN_TOKEN_ENV,
    DEFAULT_DECODE_GROUPS,
    GIB,
    HOST_KEY_ENV,
    OUTBOX_DIR_ENV,
    AgentConfig,
    AgentConfigError,
    env_broker_url,
)
from gpu_runtime.agent.vllm.options import add_engine_options, vllm_bin
from gpu_runtime.contract.broker import broker_transport, broker_transport_options
from gpu_runtime.contract.hparams import DEFAULT_LORA_MAX_RANK
from gpu_runtime.contract.log_format import LOG_FORMATS, configure_logging

logger = logging.getLogger("gpu_runtime.agent")


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m gpu_runtime.agent", description=__doc__)
    p.add_argument("--host", required=True, help="host name registered in the control plane")
    _add_log_format(p)
    p.add_argument("--base-model", default=env("HARLI_BASE_MODEL", "tiny"))
    p.add_argument("--model-dir", default=env("HARLI_MODEL_DIR") or None,
                   help="HF model directory (default: the tiny built-in model)")  # fmt: skip
    p.add_argument("--device", default=env("HARLI_DEVICE", "cpu"))
    p.add_argument("--dtype", default=None)
    p.add_argument("--tensor-parallel-size", type=int,
                   default=int(env("HARLI_TENSOR_PARALLEL_SIZE") or 1),
                   help="the engine's tensor-parallel degree T: above 1 an engine group on "
                   "devices 0..T-1 (CPU: T gloo ranks), without the unified memory "
                   "pool")  # fmt: skip
    p.add_argument("--broker", default=env_broker_url(), help="Celery broker URL")
    p.add_argument("--broker-dir", default=env("HARLI_BROKER_DIR") or None)
    p.add_argument("--storage", default=env("HARLI_STORAGE_DIR", "var/storage"))
    p.add_argument("--work-dir", default=None, help="default: var/agents/<host>")
    p.add_argument("--outbox-dir", default=env(OUTBOX_DIR_ENV) or None,
                   help="durable outbox of reports the broker has not confirmed, on local "
                   f"persistent disk (default: the environment's {OUTBOX_DIR_ENV}, else "
                   "<work-dir>/outbox)")  # fmt: skip
    p.add_argument("--outbox-max-reports", type=int, default=AgentConfig.outbox_max_reports,
                   help="reports the outbox holds before it refuses progress and metrics "
                   "reports (job lifecycle reports are kept past it)")  # fmt: skip
    p.add_argument("--outbox-max-mb", type=float,
                   default=AgentConfig.outbox_max_bytes / 2**20,
                   help="MiB the outbox holds before it refuses progress and metrics "
                   "reports")  # fmt: skip
    p.add_argument("--control-url", default=env("HARLI_CONTROL_URL", "http://127.0.0.1:8000"))
    p.add_argument("--host-key-file", default=None,
                   help="file holding this host's grant key (`manage.py hosts key NAME`); "
                   f"default: the environment's {HOST_KEY_ENV}")  # fmt: skip
    p.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory the operator's /v1/load_lora_adapter may load adapters "
        f"from (repeatable; needs {ADMIN_TOKEN_ENV})",
    )
    p.add_argument("--allow-tenant-keys", action="store_true",
                   help="also accept a request without a grant by its tenant's API key, "
                   "checked against the control plane (--control-url)")  # fmt: skip
    p.add_argument("--listen", default="127.0.0.1:8100", help="inference server host:port")
    p.add_argument("--max-prompts-per-request", type=int,
                   default=AgentConfig.max_prompts_per_request,
                   help="most prompts one completion request may carry (more: 400)")  # fmt: skip
    p.add_argument("--max-request-prompt-tokens", type=int, default=None,
                   help="most prompt tokens one request may carry in all (more: 400; default "
                   "32 x the model's context, --max-model-len)")  # fmt: skip
    p.add_argument("--heartbeat-s", type=float, default=float(env("HARLI_HEARTBEAT_S", "2")))
    p.add_argument("--metrics-interval-s", type=float,
                   default=float(env("HARLI_METRICS_INTERVAL_S", "5")))  # fmt: skip
    p.add_argument("--key-cache-ttl-s", type=float,
                   default=float(env("HARLI_KEY_CACHE_TTL_S", "10")))  # fmt: skip
    p.add_argument("--tpot-slo-ms", type=float, default=50.0)
    p.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=None,
        help="the deployment's TTFT SLO: harli's idle time slices take at most half "
        "of it (default: up to its quantum cap)",
    )
    p.add_argument("--policy", choices=["naive", "decode_only", "harli"],
                   default=env("HARLI_POLICY", "harli"),
                   help="co-location policy (harli falls back to naive on a host without a "
                        "latency predictor for its model)")  # fmt: skip
    p.add_argument("--predictor", default=env("HARLI_PREDICTOR") or None,
                   help="latency predictor artifact directory, or a root holding "
                   "<gpu>/<base model>/<version>/ (latest taken)")  # fmt: skip
    p.add_argument("--memory-gb", type=float, default=16.0, help="host memory to report on CPU")
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64, help="largest decode batch")
    p.add_argument("--max-batched-tokens", type=int, default=512,
                   help="token budget of one engine step (decode rows + prefill chunk tokens; "
                   "longer prompts are prefilled in chunks)")  # fmt: skip
    p.add_argument("--mixed-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: replay steps carrying prefill chunks from captured graphs "
                   "(--no-mixed-graphs launches them eagerly)")  # fmt: skip
    p.add_argument("--memory-pool", choices=["auto", "on", "off"], default="auto",
                   help="unified KV/finetune memory pool (auto: on CUDA devices)")  # fmt: skip
    p.add_argument("--memory-pool-gb", type=float, default=None,
                   help="pool size (CPU: required with --memory-pool on; CUDA: default "
                   "free device memory less 4 GiB)")  # fmt: skip
    p.add_argument("--decode-groups", default=",".join(map(str, DEFAULT_DECODE_GROUPS)),
                   help="CUDA: decode SM splits in units of 8 SMs (Hopper), comma-separated; "
                   "'all' creates every split")  # fmt: skip
    p.add_argument("--lora-slots", type=int, default=8, help="adapters resident at once")
    p.add_argument(
        "--lora-max-rank",
        type=int,
        default=DEFAULT_LORA_MAX_RANK,
        help="largest adapter rank served",
    )
    add_engine_options(p)
    args = p.parse_args(argv)
    bind_host, _, port = args.listen.rpartition(":")
    host_key = _host_key(p, args.host_key_file)
    work_dir = Path(args.work_dir or f"var/agents/{args.host}")
    try:
        return AgentConfig(
            host=args.host,
            broker_url=args.broker,
            storage=args.storage,
            work_dir=work_dir,
            outbox_dir=Path(args.outbox_dir) if args.outbox_dir else work_dir / "outbox",
            outbox_max_reports=args.outbox_max_reports,
            outbox_max_bytes=int(args.outbox_max_mb * 2**20),
            base_model=args.base_model,
            model_dir=Path(args.model_dir) if args.model_dir else None,
            device=args.device,
            dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            control_url=args.control_url,
            host_key=host_key,
            metrics_token=os.environ.get("HARLI_METRICS_TOKEN") or None,
            admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None,
            adapter_roots=tuple(Path(root).resolve() for root in args.adapter_root),
            allow_tenant_keys=args.allow_tenant_keys,
            server_host=bind_host or "127.0.0.1",
            server_port=int(port),
            max_prompts_per_request=args.max_prompts_per_request,
            max_request_prompt_tokens=args.max_request_prompt_tokens,
            heartbeat_s=args.heartbeat_s,
            metrics_interval_s=args.metrics_interval_s,
            key_cache_ttl_s=args.key_cache_ttl_s,
            tpot_slo_ms=args.tpot_slo_ms,
            ttft_slo_ms=args.ttft_slo_ms,
            policy=args.policy,
            memory_bytes=int(args.memory_gb * GIB),
            num_kv_blocks=args.num_kv_blocks,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_batched_tokens,
            mixed_cuda_graphs=args.mixed_graphs,
            lora_slots=args.lora_slots,
            decode_groups=_decode_groups(p, args.decode_groups),
            memory_pool={"auto": None, "on": True, "off": False}[args.memory_pool],
            memory_pool_bytes=int(args.memory_pool_gb * GIB) if args.memory_pool_gb else None,
            predictor_path=Path(args.predictor) if args.predictor else None,
            lora_max_rank=args.lora_max_rank,
            broker_dir=Path(args.broker_dir) if args.broker_dir else None,
            engine=args.engine,
            vllm_bin=vllm_bin(args.vllm_bin) if args.engine == "vllm" else None,
            vllm_port=args.vllm_port,
            vllm_ready_timeout_s=args.vllm_ready_timeout_s,
            vllm_args=tuple(arg for group in args.vllm_arg for arg in group.split()),
        )
    except (AgentConfigError, ValueError) as exc:
        p.error(str(exc))
        raise


def _host_key(parser: argparse.ArgumentParser, path: str | None) -> str | None:
    """The host key from `path` when given, else from the environment (None: neither)."""
    if path is None:
        return os.environ.get(HOST_KEY_ENV, "").strip() or None
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--host-key-file {path}: cannot read it ({type(exc).__name__})")
    if not text:
        parser.error(f"--host-key-file {path} is empty")
    return text


def _decode_groups(parser: argparse.ArgumentParser, text: str) -> tuple[int, ...] | None:
    if text == "all":
        return None
    try:
        groups = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        parser.error(f"--decode-groups {text!r}: expected comma-separated integers or 'all'")
    if not groups or min(groups) < 1:
        parser.error(f"--decode-groups {text!r}: expected positive integers")
    return groups


def build_policy(
    name: str, predictor: Any, device: str = "cpu", ttft_slo_ms: float | None = None
) -> Any:
    """The co-location policy `name` for an engine; "harli" plans with the host's predictor,
    corrected online by the loop's own iterations (``CorrectedLatencyModel``; one batched ONNX
    call per plan), and falls back to "naive", logged, when the host has none for its model.
    Harli's knobs for this host (`device`, the deployment's `ttft_slo_ms`) come from
    ``host_harli_config``."""
    from gpu_runtime.colocation import DecodeOnlyPolicy, HarliPolicy, NaivePolicy
    from gpu_runtime.colocation.corrected import CorrectedLatencyModel
    from gpu_runtime.colocation.harli_config import host_harli_config

    if name == "decode_only":
        return DecodeOnlyPolicy()
    if name == "harli":
        if predictor is not None:
            config = host_harli_config(device, ttft_slo_ms)
            return HarliPolicy(CorrectedLatencyModel(predictor.predictor), config)
        logger.warning("no latency predictor for this model: co-location policy naive")
    return NaivePolicy(quantum_examples=4)


def _total_bytes(config: AgentConfig) -> int:
    if not config.device.startswith("cuda"):
        return config.memory_bytes
    import torch

    return int(torch.cuda.get_device_properties(torch.device(config.device)).total_memory)


HOST_QUEUE_LOST_EXIT = 3
"""Exit status when the host-queue consumer gave up: the host would heartbeat but take no
command, so the agent ends and its supervisor (run.sh, systemd) sees it."""


def run_agent(config: AgentConfig, stop: threading.Event) -> int:
    """Run until `stop` is set (see the module docstring); the process's exit status.
    AgentConfigError without a host key: it signs every report and verifies every command."""
    from kombu import Connection

    from gpu_runtime.agent.channel import CommandConsumer, ReportSender
    from gpu_runtime.agent.checkpoint_models import CheckpointModels
    from gpu_runtime.agent.host_auth import host_auth
    from gpu_runtime.agent.operator_adapters import OperatorAdapters
    from gpu_runtime.agent.outbox import DiskOutbox
    from gpu_runtime.agent.runtime import HostRuntime, submit_command
    from gpu_runtime.agent.serving import EngineSpec
    from gpu_runtime.agent.tp_serving import FollowerJobBuilder
    from gpu_runtime.colocation.ahead import ASYNC_SCHEDULING
    from gpu_runtime.contract.message_auth import message_key, message_sign
    from gpu_runtime.contract.protocol import report
    from gpu_runtime.contract.storage import open_storage
    from gpu_runtime.contract.tensor_parallel import TensorParallelError
    from gpu_runtime.engine import EngineConfig
    from gpu_runtime.model.tiny import build_tiny_model_dir
    from gpu_runtime.server import EngineLoop, MetricsCollector, create_app
    from gpu_runtime.server.adapter_admin import AdapterAdmin
    from gpu_runtime.server.prometheus import ServerMetrics
    from gpu_runtime.server.threaded import ThreadedServer

    if config.engine == "vllm":
        from gpu_runtime.agent.vllm.agent import run_vllm_agent

        return run_vllm_agent(config, stop, _total_bytes(config))
    if config.host_key is None:
        raise AgentConfigError(
            f"a host key is required (--host-key-file or {HOST_KEY_ENV}; `manage.py hosts key "
            f"{config.host}`): it signs every report and verifies every command"
        )
    key = message_key(config.host_key)
    work_dir = config.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    storage = open_storage(config.storage)
    model_dir = config.model_dir
    if model_dir is None:
        model_dir = work_dir / "tiny-model"
        if not (model_dir / "config.json").is_file():
            build_tiny_model_dir(model_dir, seed=0)
    spec = EngineSpec(
        EngineConfig(
            num_kv_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            device=config.device,
            mixed_cuda_graphs=config.mixed_cuda_graphs,
            async_scheduling=ASYNC_SCHEDULING,  # the loop plans each step ahead
        ),
        dtype=config.dtype,
        lora_slots=config.lora_slots,
        lora_max_rank=config.lora_max_rank,
        memory_pool=config.memory_pool,
        pool_bytes=config.memory_pool_bytes,
        decode_groups=config.decode_groups,
        tensor_parallel_size=config.tensor_parallel_size,
        jobs=FollowerJobBuilder(storage, work_dir) if config.tensor_parallel_size > 1 else None,
    )
    try:
        serving = spec.build(model_dir)
    except TensorParallelError as exc:  # the degree does not divide the model's heads/widths
        raise AgentConfigError(
            f"--tensor-parallel-size {config.tensor_parallel_size} for {model_dir}: {exc}"
        ) from exc
    options = broker_transport_options(config.broker_url, config.broker_dir)
    transport = broker_transport(config.broker_url)
    outbox = DiskOutbox(config.outbox_path(), config.outbox_max_reports, config.outbox_max_bytes)
    sender = ReportSender(config.broker_url, options, transport, outbox)
    sender.start()

    def send(message: dict[str, Any]) -> None:
        # Signed as it is built: a report waiting in the sender's outbox stays valid.
        sender.send(message_sign(message, key))

    request_metrics = MetricsCollector()
    prometheus = ServerMetrics()
    runtime = HostRuntime(
        host=config.host,
        base_model=config.base_model,
        serving=serving,
        engine_spec=spec,
        policy=functools.partial(
            build_policy, config.policy, device=config.device, ttft_slo_ms=config.ttft_slo_ms
        ),
        tpot_slo_ms=config.tpot_slo_ms,
        storage=storage,
        work_dir=work_dir,
        send=send,
        total_bytes=_total_bytes(config),
        base_model_path=str(model_dir),
        metrics_interval_s=config.metrics_interval_s,
        request_metrics=request_metrics,
        predictor_path=config.predictor_path,
        prometheus=prometheus,
    )
    loop = EngineLoop(runtime)
    loop.start()
    app = create_app(
        loop,
        lambda: runtime.status().base_model,
        host_auth(config),
        request_metrics,
        model_loader=CheckpointModels(loop, runtime),
        limits=config.request_limits(),
        prometheus=prometheus,
        metrics_token=config.metrics_token,
        adapter_admin=(
            AdapterAdmin(config.admin_token, config.adapter_roots, OperatorAdapters(runtime))
            if config.admin_token
            else None
        ),
    )
    if config.metrics_token is None:
        logger.info("GET /metrics is off: HARLI_METRICS_TOKEN is not set")
    server = ThreadedServer(app, config.server_host, config.server_port)
    server.start()
    server_url = config.advertise_url or server.url

    def on_command(command: dict[str, Any]) -> None:
        submit_command(loop, runtime, command)

    connection = Connection(config.broker_url, transport=transport, transport_options=options)
    consumer = CommandConsumer(connection, config.host, on_command, key)
    consumer.start()
    logger.info("agent %s serving %s at %s", config.host, config.base_model, server_url)
    print(f"agent {config.host} ready: {server_url}", flush=True)
    status = 0
    try:
        while not stop.is_set():
            if not consumer.alive():
                logger.critical("the host-queue consumer of %s has stopped; exiting", config.host)
                status = HOST_QUEUE_LOST_EXIT
                break
            fields = runtime.status().heartbeat_fields()
            send(report("heartbeat", config.host, server_url=server_url, **fields))
            stop.wait(config.heartbeat_s)
    finally:
        consumer.stop()
        server.stop()
        loop.stop()
        sender.stop()
        outbox.close()
    return status


LOG_FORMAT_ENV = "HARLI_LOG_FORMAT"


def _add_log_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", choices=list(LOG_FORMATS),
                        default=os.environ.get(LOG_FORMAT_ENV) or "text",
                        help="log lines as JSON objects (production) or readable text; every "
                        f"line names its request id (default: the environment's "
                        f"{LOG_FORMAT_ENV}, else text)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    early = argparse.ArgumentParser(add_help=False)
    _add_log_format(early)
    known, _ = early.parse_known_args(argv)
    if known.log_format not in LOG_FORMATS:  # from the environment, which choices skip
        early.error(f"{LOG_FORMAT_ENV}={known.log_format!r}: expected one of {list(LOG_FORMATS)}")
    configure_logging(
        log_format=known.log_format,
        level=os.environ.get("HARLI_LOG_LEVEL", "INFO"),
        loggers=["gpu_runtime", "harli", "predictor_models", "uvicorn"],
    )
    config = parse_args(argv)
    if config.device == "cpu" and "HARLI_TORCH_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["HARLI_TORCH_THREADS"]))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    from gpu_runtime.agent.vllm.supervisor import VllmStartError

    try:
        status = run_agent(config, stop)
    except (AgentConfigError, VllmStartError) as exc:
        sys.exit(f"harli agent: {exc}")
    sys.exit(status)
