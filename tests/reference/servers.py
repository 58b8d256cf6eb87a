"""The two OpenAI servers of the reference tier, each a subprocess on a free loopback port:
vLLM's (`python -m vllm.entrypoints.openai.api_server` from its own virtual environment, CPU,
fp32) and ours (`python -m gpu_runtime.server`), on the same model directory and adapters.

A server is ready when `GET /health` answers 200 (polled, no fixed sleep); one that exits or
stays unready past its deadline fails with its log's tail. Each runs in its own process group,
ended by its own id on exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV_ENV = "HARLI_VLLM_VENV"
"""Where the vLLM virtual environment is (default: `.venv-vllm` at the repository root, as
`scripts/vllm_env.sh` builds it)."""
API_KEY = "sk-reference"
MODEL = "tiny"
MAX_MODEL_LEN = 256


def vllm_python() -> Path:
    """The vLLM environment's interpreter (it may not exist: the tier then skips)."""
    venv = REPO / Path(os.environ.get(VLLM_VENV_ENV) or ".venv-vllm")  # relative: to the repo
    return venv / "bin" / "python"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(log: Path, lines: int = 40) -> str:
    text = [
        line
        for line in log.read_text(errors="replace").splitlines()
        if not line.startswith("WARNING: Location")  # pip's index noise, not the server's
    ]
    return "\n".join(text[-lines:])


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Poll `url` + `/health` until it answers 200; RuntimeError (with the log's tail) when the
    process exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{_tail(log)}")


@contextmanager
def serve(
    argv: Sequence[str], log: Path, env: dict[str, str], port: int, timeout_s: float
) -> Iterator[str]:
    """Run `argv` until the block ends; yields its `/v1` base URL once healthy."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            cwd=REPO,
            start_new_session=True,
        )
    try:
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, process, log, timeout_s)
        yield root + "/v1"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def vllm_argv(model_dir: Path, adapters: dict[str, Path], port: int) -> list[str]:
    """vLLM's OpenAI server on the CPU in fp32, greedy-exact (eager, no prefix caching)."""
    argv = [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--gpu-memory-utilization",
        "0.1",
        "--enforce-eager",
        "--api-key",
        API_KEY,
    ]
    if adapters:
        argv += ["--enable-lora", "--max-lora-rank", "8", "--lora-modules"]
        argv += [f"{name}={path}" for name, path in adapters.items()]
    return argv


VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
"""1 GiB of KV cache (vLLM reserves most of the memory otherwise)."""


def harli_argv(model_dir: Path, adapters: dict[str, Path], port: int) -> list[str]:
    """`python -m gpu_runtime.server` on the same model in fp32."""
    argv = [sys.executable, "-m", "gpu_runtime.server", "--model-dir", str(model_dir)]
    argv += ["--model-name", MODEL, "--dtype", "float32", "--port", str(port)]
    argv += ["--max-model-len", str(MAX_MODEL_LEN)]
    for name, path in adapters.items():
        argv += ["--adapter", f"{name}={path}"]
    return argv


HARLI_ENV = {"HARLI_INFERENCE_API_KEYS": API_KEY}
