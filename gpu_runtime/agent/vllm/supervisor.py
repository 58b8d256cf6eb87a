"""`VllmSupervisor`: one vLLM OpenAI server process for the host's deployment.

The process runs `<vllm> serve MODEL_DIR` on a loopback port with the deployment's dtype, context
length and LoRA limits (`--enable-lora --max-loras N --max-lora-rank R`), an API key only the
agent knows, and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (adapters come and go at run time). Its
output goes to `<state dir>/vllm.log` (appended across restarts). Rules:

- `start()` returns once `GET /health` answers 200; a process that exits first, or is not
  healthy by `ready_timeout_s`, is a `VllmStartError` quoting the log's tail, and leaves no
  process behind.
- A watcher thread restarts a process that died while nobody stopped it, after a backoff that
  doubles from `backoff_s` up to `max_backoff_s` (reset once a process served for
  `stable_s`); `restarts` counts them, `state` says "starting", "ready", "restarting",
  "failed" or "stopped". After a restart, `on_ready` is called (from the watcher) once the new
  process is healthy and before `state` is "ready" again, so the host loads its adapters into
  it first.
- `stop()` sends SIGTERM to the process group, then SIGKILL after `grace_s`; idempotent.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)
LOG_TAIL_LINES = 40


class VllmStartError(RuntimeError):
    """vLLM did not become healthy; the message quotes its log."""


@dataclass(frozen=True)
class VllmLaunch:
    """How to run vLLM for one deployment."""

    executable: Path
    """`<venv>/bin/vllm` (run as `vllm serve`) or `<venv>/bin/python` (run as `python -m
    vllm.entrypoints.openai.api_server`)."""
    model_dir: Path
    served_name: str
    port: int
    api_key: str = field(repr=False)
    dtype: str | None = None
    max_model_len: int = 512
    max_loras: int = 8
    max_lora_rank: int = 16
    max_num_seqs: int = 64
    host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment (e.g. `VLLM_CPU_KVCACHE_SPACE` on a CPU host)."""

    def argv(self) -> list[str]:
        exe = str(self.executable)
        if Path(exe).name.startswith("python"):
            head = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        else:
            head = [exe, "serve", str(self.model_dir)]
        argv = head + [
            "--served-model-name", self.served_name,
            "--host", self.host,
            "--port", str(self.port),
            "--api-key", self.api_key,
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--enable-lora",
            "--max-loras", str(self.max_loras),
            "--max-lora-rank", str(self.max_lora_rank),
        ]  # fmt: skip
        if self.dtype:
            argv += ["--dtype", self.dtype]
        return argv + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        return {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **dict(self.env)}

    @property
    def url(self) -> str:
        """The server's root (no `/v1`)."""
        return f"http://{self.host}:{self.port}"


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class VllmSupervisor:
    """See the module docstring."""

    def __init__(
        self,
        launch: VllmLaunch,
        state_dir: Path,
        *,
        ready_timeout_s: float = 600.0,
        grace_s: float = 20.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        stable_s: float = 120.0,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.launch = launch
        self.log_path = Path(state_dir) / "vllm.log"
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.on_ready = on_ready
        self.restarts = 0
        self.state = "stopped"
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None else None

    def running(self) -> bool:
        """Whether a vLLM process of this supervisor is alive now."""
        process = self._process
        return process is not None and process.poll() is None

    def start(self) -> None:
        """Start vLLM and wait until it is healthy (see the module docstring)."""
        self._stopping.clear()
        self._spawn_and_wait()
        self._watcher = threading.Thread(target=self._watch, name="vllm-watch", daemon=True)
        self._watcher.start()

    def _spawn_and_wait(self, before_ready: Callable[[], None] | None = None) -> None:
        self.state = "starting"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            out.write(f"--- harli: starting vLLM ({time.strftime('%H:%M:%S')})\n".encode())
            out.flush()
            with self._lock:
                self._process = subprocess.Popen(
                    self.launch.argv(),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.launch.environment(),
                    start_new_session=True,
                )
        process = self._process
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            if process.poll() is not None:
                self.state = "failed"
                raise VllmStartError(
                    f"vLLM exited with status {process.returncode} before it was ready "
                    f"(log {self.log_path}):\n{log_tail(self.log_path)}"
                )
            if healthy(self.launch.url):
                if before_ready is not None:
                    try:
                        before_ready()
                    except Exception:
                        logger.exception("after the vLLM restart")
                self.state = "ready"
                logger.info("vLLM ready at %s (pid %d)", self.launch.url, process.pid)
                return
            self._stopping.wait(0.25)
        self._terminate(process)
        self.state = "stopped" if self._stopping.is_set() else "failed"
        if not self._stopping.is_set():
            raise VllmStartError(
                f"vLLM not healthy after {self.ready_timeout_s:.0f} s "
                f"(log {self.log_path}):\n{log_tail(self.log_path)}"
            )

    def _watch(self) -> None:
        backoff = self.backoff_s
        started = time.monotonic()
        while not self._stopping.is_set():
            process = self._process
            if process is None or process.poll() is None:
                self._stopping.wait(0.2)
                continue
            if time.monotonic() - started >= self.stable_s:
                backoff = self.backoff_s
            self.state = "restarting"
            logger.error(
                "vLLM (pid %d) exited with status %s; restarting in %.1f s:\n%s",
                process.pid, process.returncode, backoff, log_tail(self.log_path, 10),
            )  # fmt: skip
            if self._stopping.wait(backoff):
                break
            backoff = min(backoff * 2, self.max_backoff_s)
            self.restarts += 1
            started = time.monotonic()
            try:
                self._spawn_and_wait(self.on_ready)
            except VllmStartError as exc:
                logger.error("vLLM restart %d failed: %s", self.restarts, exc)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; the watcher ends first."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(self.grace_s + 5)
        with self._lock:
            process = self._process
        if process is not None:
            self._terminate(process)
        self.state = "stopped"

    def _terminate(self, process: subprocess.Popen[bytes]) -> None:
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("vLLM (pid %d) ignored SIGTERM for %.0f s: SIGKILL", process.pid,
                           self.grace_s)  # fmt: skip
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        except ProcessLookupError:
            process.wait(10)
