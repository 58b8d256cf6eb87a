"""Finetune engine: LoRA training on the decode engine's own base weights, in bounded quanta.

Entry points:

* :func:`open_job` — training/validation JSONL + the job's settings -> a trainer (resuming from
  the job's latest checkpoint when there is one);
* :meth:`LoraTrainer.step_quantum` — one bounded unit of training (a micro-batch, or a few
  decoder layers of one) returning a :class:`QuantumResult`;
* :class:`DpoTrainer` — the same quanta with DPO's loss over preference pairs
  (:mod:`gpu_runtime.finetune.preference_data`), the adapter-off base model as the reference;
* :class:`MultiLoraRuntime` — finished adapters served by name beside base requests in one batch.
"""

from gpu_runtime.contract.hparams import (
    FinetuneHyperparameters,
    HyperparameterError,
    LoraSpec,
    resolve_hyperparameters,
)
from gpu_runtime.finetune.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_adapter,
    save_checkpoint,
)
from gpu_runtime.finetune.data import TokenizedDataset, TrainingDataError, load_jsonl
from gpu_runtime.finetune.dpo_trainer import DpoTrainer
from gpu_runtime.finetune.job import FinetuneJob, open_job
from gpu_runtime.finetune.lora_serving import MultiLoraRuntime
from gpu_runtime.finetune.quantum import QuantumResult, StepRecord
from gpu_runtime.finetune.trainer import LoraTrainer

__all__ = [
    "CheckpointError",
    "DpoTrainer",
    "FinetuneHyperparameters",
    "FinetuneJob",
    "HyperparameterError",
    "LoraSpec",
    "LoraTrainer",
    "MultiLoraRuntime",
    "QuantumResult",
    "StepRecord",
    "TokenizedDataset",
    "TrainingDataError",
    "latest_checkpoint",
    "load_checkpoint",
    "load_jsonl",
    "open_job",
    "resolve_hyperparameters",
    "save_adapter",
    "save_checkpoint",
]
