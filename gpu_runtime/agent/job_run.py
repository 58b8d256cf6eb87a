"""Turning a placement's JobSpec into a trainer on this host, and its files into storage.

The training file (and the validation file, when the job has one) is read from storage and
tokenized with the host's training tokenizer under the JobSpec's `max_seq_len` (the rule of
`gpu_runtime.contract.training_data`, which the control plane checked the files against before
queueing; a DPO job's, `spec["method"] == "dpo"`, hold preference pairs and train a
`DpoTrainer`); "auto" hyperparameters resolve with
`gpu_runtime.contract.hparams.resolve_hyperparameters` (deterministic in the file), so every host
that runs the job builds the same trainer and a checkpoint written on one resumes exactly on
another. Checkpoints are written locally by the trainer, then copied to storage under
`checkpoints/<job>/step-<N>`; the finished adapter goes to `adapters/<job>`.

A job that cannot start raises :class:`JobSetupError`, whose message goes to the tenant: it names
files by id and lines by number; storage keys, local paths and the underlying exception are
only logged here.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gpu_runtime.contract.chat import ChatTokenizer
from gpu_runtime.contract.hparams import (
    BASE_LEARNING_RATE,
    LoraSpec,
    resolve_dpo_beta,
    resolve_hyperparameters,
)
from gpu_runtime.contract.storage import Storage
from gpu_runtime.contract.training_data import jsonl_lines
from gpu_runtime.finetune.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    load_checkpoint,
    save_checkpoint,
)
from gpu_runtime.finetune.data import (
    ExamplesTooLongError,
    TokenizedExample,
    TrainingDataError,
    tokenize_lines,
)
from gpu_runtime.finetune.dpo_trainer import DpoTrainer
from gpu_runtime.finetune.preference_data import PreferencePair, tokenize_preference_lines
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM

logger = logging.getLogger(__name__)


T = TypeVar("T")


class JobSetupError(RuntimeError):
    """A job that cannot start here (bad file, bad settings, missing checkpoint); `code` is the
    `job_failed` report's (`invalid_file_format`, `example_too_long`, `job_setup_failed`)."""

    def __init__(self, message: str, code: str = "job_setup_failed") -> None:
        super().__init__(message)
        self.code = code


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


def _read_file(
    storage: Storage, key: str, file_id: str, tokenize: Callable[[list[bytes], str], T]
) -> T:
    """`tokenize(lines, source)` of file `file_id` stored under `key`; JobSetupError naming the
    file by id (never by its storage key) when it cannot be read or trained on."""
    source = f"file {file_id}"
    try:
        lines = jsonl_lines(b"".join(storage.read_chunks(key)))
    except (FileNotFoundError, OSError) as exc:
        logger.error("cannot read %s (storage key %s): %s", source, key, exc)
        raise JobSetupError(f"{source} cannot be read from storage; upload it again") from exc
    try:
        return tokenize(lines, source)
    except ExamplesTooLongError as exc:
        raise JobSetupError(str(exc), code="example_too_long") from exc
    except TrainingDataError as exc:
        raise JobSetupError(str(exc), code="invalid_file_format") from exc


def read_examples(
    storage: Storage, key: str, file_id: str, tokenizer: ChatTokenizer, max_seq_len: int
) -> tuple[TokenizedExample, ...]:
    """The examples of file `file_id` stored under `key` (errors: see `_read_file`)."""

    def tokenize(lines: list[bytes], source: str) -> tuple[TokenizedExample, ...]:
        return tokenize_lines(lines, tokenizer, max_seq_len, source=source).examples

    return _read_file(storage, key, file_id, tokenize)


def read_pairs(
    storage: Storage, key: str, file_id: str, tokenizer: ChatTokenizer, max_seq_len: int
) -> tuple[PreferencePair, ...]:
    """The preference pairs of DPO file `file_id` stored under `key` (errors as above)."""

    def tokenize(lines: list[bytes], source: str) -> tuple[PreferencePair, ...]:
        return tokenize_preference_lines(lines, tokenizer, max_seq_len, source=source).pairs

    return _read_file(storage, key, file_id, tokenize)


def build_job_run(
    *,
    spec: dict[str, Any],
    placement_id: int,
    serving_model: CausalLM,
    tokenizer: ChatTokenizer | None,
    storage: Storage,
    work_dir: Path,
    base_model_path: str | None,
) -> JobRun:
    """Build the trainer for `spec`, restored from `spec["resume_from"]` when given.
    `tokenizer` is the host's training tokenizer (None: the model directory has none)."""
    job_id = str(spec["id"])
    if tokenizer is None:
        raise JobSetupError(f"host has no training tokenizer for base model {spec['base_model']}")
    workdir = Path(work_dir) / "jobs" / job_id / f"placement-{placement_id}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    max_seq_len = int(spec["max_seq_len"])
    dpo = spec.get("method", "supervised") == "dpo"
    pairs: tuple[PreferencePair, ...] = ()
    examples: tuple[TokenizedExample, ...] = ()
    key, file_id = spec["training_file_key"], str(spec["training_file"])
    validation: tuple[TokenizedExample, ...] = ()
    valid_pairs: tuple[PreferencePair, ...] = ()
    valid_key, valid_id = spec.get("validation_file_key"), str(spec.get("validation_file"))
    if dpo:
        pairs = read_pairs(storage, key, file_id, tokenizer, max_seq_len)
        if valid_key:
            valid_pairs = read_pairs(storage, str(valid_key), valid_id, tokenizer, max_seq_len)
    else:
        examples = read_examples(storage, key, file_id, tokenizer, max_seq_len)
        if valid_key:
            validation = read_examples(storage, str(valid_key), valid_id, tokenizer, max_seq_len)
    try:
        hyper = dict(spec["hyperparameters"])
        lora = dict(spec["lora"])
        options = {"dpo_beta": resolve_dpo_beta(hyper.get("beta", "auto"))} if dpo else {}
        hparams = resolve_hyperparameters(
            n_train_examples=len(pairs) if dpo else len(examples),
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
            **options,
        )
    except (ValueError, KeyError) as exc:
        raise JobSetupError(f"job {job_id}: {exc}") from exc
    common: dict[str, Any] = {
        "pad_token_id": int(getattr(tokenizer, "pad_token_id", None) or 0),
        "checkpoint_root": workdir / "checkpoints",
        "base_model_name_or_path": base_model_path,
    }
    trainer = (
        DpoTrainer(serving_model, pairs, hparams, validation_pairs=valid_pairs, **common)
        if dpo
        else LoraTrainer(serving_model, examples, hparams, validation_examples=validation, **common)
    )
    resumed = 0
    resume = spec.get("resume_from")
    if resume:
        local = workdir / "resume"
        try:
            storage.get_tree(str(resume["storage_key"]), local)
            load_checkpoint(trainer, local)
        except (FileNotFoundError, ValueError, RuntimeError) as exc:
            logger.error("job %s: cannot resume from %s: %s", job_id, resume, exc)
            raise JobSetupError(
                f"job {job_id}: the checkpoint of step {resume.get('step')} cannot be restored"
            ) from exc
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
    resolved: dict[str, Any] = {
        "n_epochs": hparams.n_epochs,
        "batch_size": hparams.batch_size,
        "learning_rate_multiplier": float(f"{hparams.learning_rate / BASE_LEARNING_RATE:.12g}"),
    }
    if hparams.dpo_beta is not None:
        resolved["beta"] = hparams.dpo_beta
    return resolved


def upload_checkpoint(storage: Storage, run: JobRun, local: Path) -> str:
    """Copy a local checkpoint directory to storage; returns its storage prefix."""
    from gpu_runtime.contract.protocol import checkpoint_key

    key = checkpoint_key(run.job_id, run.trainer.step)
    storage.put_tree(key, local)
    return key


def checkpoint_now(run: JobRun, base_model_path: str | None) -> Path:
    """Write a checkpoint of the run's trainer at its current step (between batches)."""
    return save_checkpoint(run.trainer, run.workdir / "checkpoints", base_model_path)


def upload_adapter(storage: Storage, run: JobRun, checkpoint: Path) -> str:
    """Copy the PEFT adapter files of the final checkpoint to `adapters/<job>`."""
    from gpu_runtime.contract.protocol import adapter_key

    adapter_dir = run.workdir / "adapter"
    adapter_dir.mkdir(exist_ok=True)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copyfile(checkpoint / name, adapter_dir / name)
    key = str(run.spec.get("adapter_key") or adapter_key(run.job_id))
    storage.put_tree(key, adapter_dir)
    return key
