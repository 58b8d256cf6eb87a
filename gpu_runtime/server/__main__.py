"""Run the inference server: `python -m gpu_runtime.server [--model-dir DIR] [--port 8100]`.

Without --model-dir it builds the tiny random model and tokenizer (CPU-friendly, no download)
into --tiny-dir. API keys come from HARLI_INFERENCE_API_KEYS (comma-separated). Each
`--adapter NAME=DIR` (a PEFT LoRA directory) is served as model NAME beside the base model.
Steps run with async scheduling (`--no-async-scheduling` turns it off): this is a decode-only
deployment with one SM partition, unlike the co-location host loop, which stays synchronous.
`--max-prompts-per-request` and `--max-request-prompt-tokens` hold each request to its limits
(`limits.RequestLimits`); requests of different keys are admitted in turn. `GET /metrics`
(Prometheus) answers a scrape bearing HARLI_METRICS_TOKEN; without that variable it is off.
With HARLI_HOST_ADMIN_TOKEN and one or more `--adapter-root DIR`, an operator bearing that token
loads and unloads adapters at run time (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`)
from directories under those roots; one without the other is refused at start.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from fastapi import FastAPI

from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.lora.errors import AdapterConfigError
from gpu_runtime.model.loader import load_model, load_tokenizer
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server.adapter_admin import ADMIN_TOKEN_ENV, AdapterAdmin, EngineAdapters
from gpu_runtime.server.app import create_app
from gpu_runtime.server.bearer_keys import API_KEYS_ENV, BearerKeys, keys_from_env
from gpu_runtime.server.engine_loop import EngineLoop
from gpu_runtime.server.limits import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    PROMPT_TOKENS_CONTEXTS,
    RequestLimits,
    RequestLimitsError,
)
from gpu_runtime.server.metrics_routes import METRICS_TOKEN_ENV
from gpu_runtime.server.prometheus import ServerMetrics


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m gpu_runtime.server", description=__doc__)
    parser.add_argument("--model-dir", type=Path, default=None, help="HF-format model directory")
    parser.add_argument("--tiny-dir", type=Path, default=Path("var/tiny-model"))
    parser.add_argument("--model-name", default=None, help="name clients pass as `model`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="read every step's tokens back before launching the next (the engine default; "
        "this server launches the next decode step first, since it has a single partition)",
    )
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve the PEFT LoRA adapter in DIR as model NAME (repeatable)",
    )
    parser.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        type=Path,
        metavar="DIR",
        help="a directory the operator's /v1/load_lora_adapter may load adapters from "
        f"(repeatable; needs {ADMIN_TOKEN_ENV})",
    )
    parser.add_argument("--lora-slots", type=int, default=8, help="adapters resident at once")
    parser.add_argument("--lora-max-rank", type=int, default=64, help="largest adapter rank")
    parser.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        help="most prompts one completion request may carry (more: 400)",
    )
    parser.add_argument(
        "--max-request-prompt-tokens",
        type=int,
        default=None,
        help="most prompt tokens one request may carry in all (more: 400; default "
        f"{PROMPT_TOKENS_CONTEXTS} x --max-model-len)",
    )
    args = parser.parse_args(argv)
    try:
        args.limits = RequestLimits(args.max_prompts_per_request, args.max_request_prompt_tokens)
    except RequestLimitsError as exc:
        parser.error(str(exc))
    for spec in args.adapter:
        name, sep, directory = spec.partition("=")
        if not (sep and name and directory):
            parser.error(f"--adapter {spec!r}: expected NAME=DIR")
    args.admin_token = os.environ.get(ADMIN_TOKEN_ENV) or None
    if bool(args.admin_token) != bool(args.adapter_root):
        parser.error(f"{ADMIN_TOKEN_ENV} and --adapter-root go together (set both or neither)")
    args.adapter_root = [root.resolve() for root in args.adapter_root]
    for root in args.adapter_root:
        if not root.is_dir():
            parser.error(f"--adapter-root {str(root)!r} is not a directory")
    return args


def _engine(model_dir: Path, config: EngineConfig, args: argparse.Namespace) -> Engine:
    """The engine, with a LoRA runtime holding the `--adapter`s when there are any or when
    adapters may be loaded at run time (`--adapter-root`)."""
    if not args.adapter and not args.adapter_root:
        return Engine.from_directory(model_dir, config, dtype=args.dtype)
    from gpu_runtime.lora.runtime import MultiLoraRuntime

    model = load_model(model_dir, device=config.device, dtype=args.dtype)
    lora = MultiLoraRuntime(
        model,
        max_tokens=config.max_num_batched_tokens,
        num_slots=args.lora_slots,
        max_rank=args.lora_max_rank,
    )
    for spec in args.adapter:
        name, _, directory = spec.partition("=")
        try:
            lora.register(name, Path(directory))
        except AdapterConfigError as exc:  # an option that is not served: say which, no trace
            raise SystemExit(f"--adapter {spec}: {exc}") from exc
    return Engine(model, config, tokenizer=load_tokenizer(model_dir), lora=lora)


def build(args: argparse.Namespace) -> tuple[FastAPI, EngineLoop]:
    """Engine, started engine loop and app for `args` (the caller runs and stops them)."""
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = args.tiny_dir
        if not (model_dir / "config.json").exists():
            build_tiny_model_dir(model_dir)
    config = EngineConfig(
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        use_cuda_graphs=not args.no_cuda_graphs,
        # one partition and nobody timing or re-partitioning steps: the next decode step can
        # be launched before this one's tokens are read back (EngineConfig.async_scheduling)
        async_scheduling=not args.no_async_scheduling,
    )
    engine = _engine(model_dir, config, args)
    engine.capture_cuda_graphs()
    prometheus = ServerMetrics()
    loop = EngineLoop(engine, on_step=prometheus.iteration)
    loop.start()
    name = args.model_name or Path(model_dir).name
    auth = BearerKeys(keys_from_env(API_KEYS_ENV))
    app = create_app(
        loop,
        name,
        auth,
        limits=args.limits,
        prometheus=prometheus,
        metrics_token=os.environ.get(METRICS_TOKEN_ENV) or None,
        adapter_admin=(
            AdapterAdmin(
                args.admin_token,
                tuple(args.adapter_root),
                EngineAdapters(lambda: loop.engine),
            )
            if args.admin_token
            else None
        ),
    )
    return app, loop


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until interrupted."""
    import uvicorn

    args = parse_args(argv)
    app, loop = build(args)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        loop.stop()


if __name__ == "__main__":
    main()
