"""The host's engine at tensor-parallel degree T > 1: an engine group on devices 0..T-1.

`build_group_engine` checks the degree against the model directory's shape
(`gpu_runtime.contract.tensor_parallel.check_tensor_parallel`: a `TensorParallelError` naming
the shape), then starts an engine group (`gpu_runtime.engine.engine_group`) over the
directory: rank 0 here (cuda:k, or the CPU with gloo), ranks 1..T-1 spawned. Every rank builds
the adapter runtime of the host's LoRA settings over its shard (rank 0's mirrors its calls),
each follower its GPU sharing like `host_factory.host_sharing` on its own device, and its
finetune jobs with `FollowerJobBuilder`. No unified memory pool (`HostLoop` refuses one at
TP > 1).

Jobs. Rank 0 adds a placed job to the loop with the spec `job_spec_message` builds (the
placement id, the control plane's JobSpec, the base model's directory); each follower's
`FollowerJobBuilder` builds the same trainer from it (`job_run.build_job_run`: the training
file read from the object store, hyperparameters resolved, the seed, the resume checkpoint
cut to the rank's slice) over its shard, in a work directory of its own
(`<work_dir>/tp-rank-<r>`): rank 0 alone writes checkpoint files. The builder is a picklable
dataclass (the storage, which must pickle: `LocalStorage` does, and the work directory),
pickled into the spawned followers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_runtime.agent.host_factory import ServingEngine, capture_decode_graphs, host_sharing
from gpu_runtime.contract.storage import Storage
from gpu_runtime.contract.tensor_parallel import check_tensor_parallel


@dataclass(frozen=True)
class FollowerJobBuilder:
    """A follower's job factory: `(job_id, spec, serving shard) -> trainer`, `spec` as
    `job_spec_message` builds it (see the module docstring)."""

    storage: Storage
    work_dir: Path

    def __call__(self, job_id: str, spec: Any, serving: Any) -> Any:
        from gpu_runtime.agent.job_run import build_job_run
        from gpu_runtime.contract.tokenizer import load_training_tokenizer

        base_model_path = spec["base_model_path"]
        run = build_job_run(
            spec=spec["job"],
            placement_id=int(spec["placement_id"]),
            serving_model=serving,
            tokenizer=load_training_tokenizer(base_model_path),
            storage=self.storage,
            work_dir=Path(self.work_dir) / f"tp-rank-{serving.parallel.rank}",
            base_model_path=base_model_path,
        )
        if run.job_id != job_id:
            raise ValueError(f"follower job spec names {run.job_id!r}, not {job_id!r}")
        return run.trainer


def job_spec_message(
    placement_id: int, spec: dict[str, Any], base_model_path: str | None
) -> dict[str, Any]:
    """What `HostLoop.add_job(..., spec=)` carries to the followers for a placed job."""
    return {"placement_id": placement_id, "job": spec, "base_model_path": base_model_path}


def build_group_engine(
    model_dir: Path,
    config: Any,
    size: int,
    *,
    dtype: str | None,
    lora_slots: int,
    lora_max_rank: int,
    decode_groups: tuple[int, ...] | None,
    jobs: FollowerJobBuilder,
) -> ServingEngine:
    """The engine group of `size` ranks over `model_dir` (see the module docstring);
    `config.max_model_len` is already capped by the model."""
    import torch

    from gpu_runtime.colocation.tp_follower_jobs import FollowerJobsFactory
    from gpu_runtime.engine.engine_group import ModelSource, start_engine_group
    from gpu_runtime.engine.tp_messages import LoraSettings
    from gpu_runtime.model.loader import load_config, load_tokenizer

    check_tensor_parallel(load_config(model_dir), size)
    device = str(config.device)
    group = start_engine_group(
        ModelSource(directory=str(model_dir), dtype=dtype),
        config,
        size,
        tokenizer=load_tokenizer(model_dir),
        cpu_threads=None if device.startswith("cuda") else torch.get_num_threads(),
        lora=LoraSettings(num_slots=lora_slots, max_rank=lora_max_rank),
        follower_sharing=functools.partial(host_sharing, decode_groups=decode_groups),
        follower_part=FollowerJobsFactory(jobs),
    )
    try:
        sharing = host_sharing(device, decode_groups)
        capture_decode_graphs(group.engine, sharing)
    except BaseException:
        group.shutdown()
        raise
    return ServingEngine(group.engine, None, sharing, group)
