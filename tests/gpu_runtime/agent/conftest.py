"""Fixtures: a tiny model directory, storage with a training file, and a running HostRuntime."""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.storage import LocalStorage
from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401

PAIRS = [
    ("Q: colour of the sky?", " A: blue"),
    ("Q: hello", " A: world"),
    ("Q: numbers", " A: 1 2 3 4 5"),
    ("Q: adapters", " A: low-rank"),
    ("Q: the sea", " A: a short poem about the sea"),
    ("Q: decode", " A: reads every weight once per step"),
]
TRAIN_KEY = "files/t1/file-train.jsonl"


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
        "training_file_key": TRAIN_KEY,
        "validation_file_key": None,
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


def make_runtime(model_dir: Path, storage: LocalStorage, work_dir: Path, send: Any) -> Any:
    from gpu_runtime.agent.adapters import AdapterEngines
    from gpu_runtime.agent.runtime import HostRuntime
    from gpu_runtime.colocation import NaivePolicy
    from gpu_runtime.engine import Engine, EngineConfig
    from gpu_runtime.model.loader import load_model, load_tokenizer

    model = load_model(model_dir, device="cpu")
    tokenizer = load_tokenizer(model_dir)
    config = EngineConfig(
        num_kv_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
        max_model_len=256,
    )  # fmt: skip
    engine = Engine(model, config, tokenizer=tokenizer)
    adapters = AdapterEngines(model, config, tokenizer, storage, work_dir, 16)
    return HostRuntime(
        host="h1",
        base_model="tiny",
        engine=engine,
        policy=NaivePolicy(quantum_examples=2),
        tpot_slo_ms=1e6,
        adapters=adapters,
        tokenizer=tokenizer,
        storage=storage,
        work_dir=work_dir,
        send=send,
        total_bytes=2**30,
        max_model_len=256,
        base_model_path=str(model_dir),
        metrics_interval_s=0.5,
    )


@pytest.fixture()
def reports() -> Reports:
    return Reports()


@pytest.fixture()
def runtime(tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports) -> Any:
    rt = make_runtime(tiny_model_dir, storage, tmp_path / "work", reports)
    rt.start()
    yield rt
    rt.stop()
