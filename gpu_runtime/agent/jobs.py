"""Turning a placement's JobSpec into a trainer on this host, and its files into storage.

The training (and validation) file is read from storage; "auto" hyperparameters resolve with
`gpu_runtime.finetune.hparams.resolve_hyperparameters` (deterministic in the file), so every host
that runs the job builds the same trainer and a checkpoint written on one resumes exactly on
another. Checkpoints are written locally by the trainer, then copied to storage under
`checkpoints/<job>/step-<N>`; the finished adapter goes to `adapters/<job>`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_runtime.finetune.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    load_checkpoint,
    save_checkpoint,
)
from gpu_runtime.finetune.data import TokenizedExample, tokenize_lines
from gpu_runtime.finetune.hparams import BASE_LEARNING_RATE, LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM
from gpu_runtime.storage import Storage

MAX_SEQ_LEN_CAP = 2048


class JobSetupError(RuntimeError):
    """A job that cannot start here (bad file, bad settings, missing checkpoint)."""


@dataclass
class JobRun:
    """One placed job on this host."""

    placement_id: int
    job_id: str
    spec: dict[str, Any]
    trainer: LoraTrainer
    workdir: Path
    resumed_from_step: int
    stopping: str | None = None
    """None while training; "paused" or "cancelled" once the control plane asked."""
    reported_step: int = 0
    checkpointed_step: int = 0
    """The step of the last checkpoint reported; its report lists the steps since the one
    before (so the control plane can recover a progress report the broker lost)."""
    tokens_since_report: int = 0
    started_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def trained_tokens(self) -> int:
        return sum(record.tokens for record in self.trainer.history)


def read_examples(
    storage: Storage, key: str, tokenizer: Any, max_seq_len: int
) -> tuple[TokenizedExample, ...]:
    text = b"".join(storage.read_chunks(key)).decode("utf-8")
    return tokenize_lines(text.splitlines(), tokenizer, max_seq_len, source=key).examples


def build_job_run(
    *,
    spec: dict[str, Any],
    placement_id: int,
    serving_model: CausalLM,
    tokenizer: Any,
    storage: Storage,
    work_dir: Path,
    max_model_len: int,
    base_model_path: str | None,
) -> JobRun:
    """Build the trainer for `spec`, restored from `spec["resume_from"]` when given."""
    job_id = str(spec["id"])
    workdir = Path(work_dir) / "jobs" / job_id / f"placement-{placement_id}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    max_seq_len = min(max_model_len, MAX_SEQ_LEN_CAP)
    try:
        examples = read_examples(storage, spec["training_file_key"], tokenizer, max_seq_len)
        valid_key = spec.get("validation_file_key")
        validation = (
            read_examples(storage, str(valid_key), tokenizer, max_seq_len) if valid_key else ()
        )
        hyper = dict(spec["hyperparameters"])
        lora = dict(spec["lora"])
        hparams = resolve_hyperparameters(
            n_train_examples=len(examples),
            n_epochs=hyper.get("n_epochs", "auto"),
            batch_size=hyper.get("batch_size", "auto"),
            learning_rate_multiplier=hyper.get("learning_rate_multiplier", "auto"),
            lora=LoraSpec(
                rank=int(lora["rank"]),
                alpha=float(lora["alpha"]),
                dropout=float(lora["dropout"]),
                target_modules=tuple(lora["target_modules"]),
            ),
            seed=int(spec["seed"]),
            max_seq_len=max_seq_len,
            checkpoint_every_steps=int(spec.get("checkpoint_every_steps", 0)),
        )
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise JobSetupError(f"job {job_id}: {exc}") from exc
    trainer = LoraTrainer(
        serving_model,
        examples,
        hparams,
        pad_token_id=int(getattr(tokenizer, "pad_token_id", None) or 0),
        checkpoint_root=workdir / "checkpoints",
        base_model_name_or_path=base_model_path,
        validation_examples=validation,
    )
    resumed = 0
    resume = spec.get("resume_from")
    if resume:
        local = workdir / "resume"
        try:
            storage.get_tree(str(resume["storage_key"]), local)
            load_checkpoint(trainer, local)
        except (FileNotFoundError, ValueError, RuntimeError) as exc:
            raise JobSetupError(f"job {job_id}: cannot resume from {resume}: {exc}") from exc
        resumed = trainer.step
    return JobRun(
        placement_id=placement_id,
        job_id=job_id,
        spec=spec,
        trainer=trainer,
        workdir=workdir,
        resumed_from_step=resumed,
        reported_step=resumed,
        checkpointed_step=resumed,
    )


def resolved_hyperparameters(trainer: LoraTrainer) -> dict[str, Any]:
    """What the job's "auto" settings became on this host, in the control plane's names."""
    hparams = trainer.hparams
    return {
        "n_epochs": hparams.n_epochs,
        "batch_size": hparams.batch_size,
        "learning_rate_multiplier": float(f"{hparams.learning_rate / BASE_LEARNING_RATE:.12g}"),
    }


def upload_checkpoint(storage: Storage, run: JobRun, local: Path) -> str:
    """Copy a local checkpoint directory to storage; returns its storage prefix."""
    from gpu_runtime.agent.protocol import checkpoint_key

    key = checkpoint_key(run.job_id, run.trainer.step)
    storage.put_tree(key, local)
    return key


def checkpoint_now(run: JobRun, base_model_path: str | None) -> Path:
    """Write a checkpoint of the run's trainer at its current step (between batches)."""
    return save_checkpoint(run.trainer, run.workdir / "checkpoints", base_model_path)


def upload_adapter(storage: Storage, run: JobRun, checkpoint: Path) -> str:
    """Copy the PEFT adapter files of the final checkpoint to `adapters/<job>`."""
    from gpu_runtime.agent.protocol import adapter_key

    adapter_dir = run.workdir / "adapter"
    adapter_dir.mkdir(exist_ok=True)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copyfile(checkpoint / name, adapter_dir / name)
    key = str(run.spec.get("adapter_key") or adapter_key(run.job_id))
    storage.put_tree(key, adapter_dir)
    return key
