"""One finetune job on a runtime host: files + the control plane's settings -> a trainer.

:func:`open_job` reads and tokenizes the training (and optional validation) JSONL, resolves the
job's OpenAI-style hyperparameters ("auto" included, see :mod:`gpu_runtime.contract.hparams`),
builds a :class:`LoraTrainer` over the serving model's tensors and, when ``checkpoint_root``
already holds a checkpoint of this job (a host that lost the job, or a restart), resumes from the
latest one. The host loop then calls ``job.trainer.step_quantum(...)`` between decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_runtime.contract.chat import ChatTokenizer
from gpu_runtime.contract.hparams import AUTO, LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.checkpoint import latest_checkpoint, load_checkpoint
from gpu_runtime.finetune.data import TokenizedDataset, load_jsonl
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM


@dataclass
class FinetuneJob:
    """A running job: its trainer, its data, and where it resumed from (if it did)."""

    trainer: LoraTrainer
    training: TokenizedDataset
    validation: TokenizedDataset | None
    resumed_from: Path | None

    def validation_loss(self, max_tokens: int = 8192) -> float | None:
        """Mean token loss on the validation file (None without one)."""
        if self.validation is None:
            return None
        return self.trainer.evaluate(self.validation.examples, max_tokens=max_tokens)


def open_job(
    serving: CausalLM,
    tokenizer: ChatTokenizer,
    *,
    training_file: str | Path,
    checkpoint_root: str | Path,
    validation_file: str | Path | None = None,
    hyperparameters: dict[str, Any] | None = None,
    lora: LoraSpec | None = None,
    seed: int = 0,
    base_model_name_or_path: str | None = None,
    cuda_graphs: bool | None = None,
    **options: Any,
) -> FinetuneJob:
    """Build (or resume) a job. ``hyperparameters`` holds ``n_epochs``, ``batch_size``,
    ``learning_rate_multiplier`` (numbers or "auto"); ``options`` go to
    :class:`FinetuneHyperparameters` (``max_seq_len``, ``checkpoint_every_steps``, ...);
    ``cuda_graphs`` is the trainer's (None: on for CUDA; an execution setting, not a
    hyperparameter, so a job may resume with it changed)."""
    settings = dict(hyperparameters or {})
    unknown = sorted(set(settings) - {"n_epochs", "batch_size", "learning_rate_multiplier"})
    if unknown:
        raise ValueError(f"unknown hyperparameters {unknown}")
    max_seq_len = int(options.get("max_seq_len", 2048))
    training = load_jsonl(training_file, tokenizer, max_seq_len)
    validation = (
        None if validation_file is None else load_jsonl(validation_file, tokenizer, max_seq_len)
    )
    hparams = resolve_hyperparameters(
        n_train_examples=len(training.examples),
        n_epochs=settings.get("n_epochs", AUTO),
        batch_size=settings.get("batch_size", AUTO),
        learning_rate_multiplier=settings.get("learning_rate_multiplier", AUTO),
        lora=lora,
        seed=seed,
        **options,
    )
    pad = getattr(tokenizer, "pad_token_id", None)
    trainer = LoraTrainer(
        serving,
        training.examples,
        hparams,
        pad_token_id=pad if isinstance(pad, int) else 0,
        checkpoint_root=checkpoint_root,
        base_model_name_or_path=base_model_name_or_path,
        cuda_graphs=cuda_graphs,
        validation_examples=() if validation is None else validation.examples,
    )
    resumed = latest_checkpoint(checkpoint_root) if Path(checkpoint_root).exists() else None
    if resumed is not None:
        load_checkpoint(trainer, resumed)
    return FinetuneJob(trainer, training, validation, resumed)
