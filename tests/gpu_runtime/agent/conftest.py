"""Fixtures: a tiny model directory, storage with a training file, and a running host (a
`HostRuntime` driven by a started `EngineLoop`)."""

from __future__ import annotations

import asyncio
import json
import queue
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.contract.storage import LocalStorage
from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401

PAIRS = [
    ("Q: colour of the sky?", " A: blue"),
    ("Q: hello", " A: world"),
    ("Q: numbers", " A: 1 2 3 4 5"),
    ("Q: adapters", " A: low-rank"),
    ("Q: the sea", " A: a short poem about the sea"),
    ("Q: decode", " A: reads every weight once per step"),
]
TRAIN_FILE = "file-train"
TRAIN_KEY = f"files/t1/{TRAIN_FILE}.jsonl"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_runtime.model.tiny import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture()
def storage(tmp_path: Path) -> LocalStorage:
    store = LocalStorage(tmp_path / "storage")
    lines = "".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS)
    store.save(TRAIN_KEY, [lines.encode()])
    return store


def job_spec(job_id: str = "ftjob-1", resume_from: Any = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": job_id,
        "base_model": "tiny",
        "training_file": TRAIN_FILE,
        "training_file_key": TRAIN_KEY,
        "validation_file": None,
        "validation_file_key": None,
        "max_seq_len": 256,
        "hyperparameters": {"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 5},
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
        "seed": 7,
        "checkpoint_every_steps": 2,
        "fine_tuned_model": f"ft:tiny:t1::{job_id}",
        "adapter_key": f"adapters/{job_id}",
        "resume_from": resume_from,
        **extra,
    }


class Reports:
    """Collects what the runtime sends, with a blocking wait for a kind."""

    def __init__(self) -> None:
        self.items: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []

    def __call__(self, message: dict[str, Any]) -> None:
        self.items.put(message)

    def wait_for(self, kind: str, timeout: float = 60.0) -> dict[str, Any]:
        import time

        deadline = time.monotonic() + timeout
        while True:
            for message in self.seen:
                if message["kind"] == kind and not message.get("_taken"):
                    message["_taken"] = True
                    return message
            left = deadline - time.monotonic()
            if left <= 0:
                kinds = [m["kind"] for m in self.seen]
                raise AssertionError(f"no {kind} report within {timeout} s; got {kinds}")
            try:
                self.seen.append(self.items.get(timeout=left))
            except queue.Empty:
                continue

    def kinds(self) -> list[str]:
        while not self.items.empty():
            self.seen.append(self.items.get())
        return [m["kind"] for m in self.seen]


@dataclass
class Host:
    """A HostRuntime driven by a started EngineLoop, as the agent process wires them."""

    runtime: Any
    loop: Any

    def command(self, command: dict[str, Any]) -> None:
        from gpu_runtime.agent.runtime import submit_command

        submit_command(self.loop, self.runtime, command).result(60)

    def generate(self, model: str | None, prompt: Any, params: Any) -> tuple[Any, list[float]]:
        """One request's final output and its tokens' logprobs (with `params.logprobs`);
        `model` None or the base model: no adapter."""
        tokenizer = self.loop.engine.tokenizer
        ids = list(tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        lora = None if model in (None, self.runtime.base_model) else model

        async def run() -> tuple[Any, list[float]]:
            last, logprobs = None, []
            async for out in self.loop.generate(ids, params, lora):
                last = out
                logprobs += [lp.logprob for lp in out.new_logprobs]
            return last, logprobs

        return asyncio.run(run())

    def stop(self) -> None:
        self.loop.stop()


def make_runtime(
    model_dir: Path,
    storage: LocalStorage,
    work_dir: Path,
    send: Any,
    predictor_path: Path | None = None,
    pool_bytes: int | None = None,
    device: str = "cpu",
    pool: bool | None = None,
    prometheus: Any = None,
) -> Host:
    """A host (CUDA: bf16). `pool`: its KV cache and jobs share a unified memory pool (None:
    the agent's default, on CUDA only); a CPU pool needs `pool_bytes`. `prometheus`: the
    `ServerMetrics` it feeds."""
    from gpu_runtime.agent.runtime import HostRuntime
    from gpu_runtime.agent.serving import EngineSpec
    from gpu_runtime.colocation import NaivePolicy
    from gpu_runtime.engine import EngineConfig
    from gpu_runtime.server import EngineLoop, MetricsCollector

    spec = EngineSpec(
        EngineConfig(
            num_kv_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
            max_model_len=256, device=device,
        ),
        dtype="bfloat16" if device != "cpu" else None,
        lora_slots=2,
        lora_max_rank=8,
        memory_pool=pool,
        pool_bytes=pool_bytes,
    )  # fmt: skip
    runtime = HostRuntime(
        host="h1",
        base_model="tiny",
        serving=spec.build(model_dir),
        engine_spec=spec,
        policy=lambda predictor: NaivePolicy(quantum_examples=2),
        tpot_slo_ms=1e6,
        storage=storage,
        work_dir=work_dir,
        send=send,
        total_bytes=2**30,
        base_model_path=str(model_dir),
        metrics_interval_s=0.5,
        request_metrics=MetricsCollector(),
        predictor_path=predictor_path,
        prometheus=prometheus,
    )
    return Host(runtime, EngineLoop(runtime))


@pytest.fixture()
def reports() -> Reports:
    return Reports()


@pytest.fixture()
def host(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports
) -> Iterator[Host]:
    started = make_runtime(tiny_model_dir, storage, tmp_path / "work", reports)
    started.loop.start()
    yield started
    started.stop()
