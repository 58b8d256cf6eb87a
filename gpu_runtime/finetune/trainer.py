"""LoRA trainer that advances in bounded quanta a scheduler can interleave with decode.

``LoraTrainer.step_quantum(max_tokens=..., max_examples=...)`` runs one micro-batch (forward and
backward) of at most that many padded tokens / examples, never crossing an optimizer-batch
boundary, and when the micro-batch completes the job's batch it also clips, steps AdamW and
advances the learning-rate schedule. ``recompute=True`` runs that micro-batch with activation
recomputation (each decoder layer's activations recomputed in the backward: much less memory,
about one more forward of time), chosen per quantum (default: :attr:`LoraTrainer.recompute`),
with the same gradients (:mod:`gpu_runtime.finetune.fused_forward`). With ``max_layers=k`` a
quantum is smaller still: ``k`` decoder-layer passes (forward or backward) of the micro-batch
in progress (:mod:`gpu_runtime.finetune.sliced`), with identical results. It returns a
:class:`QuantumResult`. The result of training does not depend on how the scheduler sized the
quanta: every micro-batch's summed token loss is divided by the loss-token count of its whole
optimizer batch, so accumulated gradients are those of the batch mean (up to float rounding;
with LoRA dropout > 0 the masks drawn depend on the micro-batch shapes).

Randomness (LoRA dropout) comes from the trainer's own generators (:class:`TrainerRng`), swapped
in around eager work and registered with CUDA graphs, so decode sampling in the same process
neither disturbs training nor is disturbed, and a resumed run draws the same masks. One host sync
per quantum (reading loss and grad norm) is the agreed sync point; it also makes ``wall_s`` the
quantum's real duration.

On CUDA, whole-micro-batch quanta replay CUDA graphs of the forward and backward by default
(:mod:`gpu_runtime.finetune.graphs`; ``cuda_graphs=False`` turns them off): micro-batches are then
padded to sequence buckets, and the first micro-batch on a stream, layer-sliced quanta and
anything after a failed capture run eagerly (each :class:`QuantumResult` says which). A
micro-batch with recomputation is another graph (``GraphKey.recompute``). The optimizer step
(clip, fused AdamW, in-place zeroing) stays eager. The graphed launches are
:class:`~gpu_runtime.finetune.graphed.GraphedQuantaMixin`'s.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.contract.hparams import FinetuneHyperparameters
from gpu_runtime.finetune.batching import DataStream, MicroBatch, MicroBatchPlan, collate
from gpu_runtime.finetune.checkpoint import save_checkpoint
from gpu_runtime.finetune.data import TokenizedExample
from gpu_runtime.finetune.fused_forward import FusedTrainingForward
from gpu_runtime.finetune.graph_policy import CapturePolicy
from gpu_runtime.finetune.graphed import GraphedQuantaMixin
from gpu_runtime.finetune.graphs import MicroBatchGraphs
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.finetune.loss import PeftTreeStack, chunked_lm_head_loss, training_hidden_states
from gpu_runtime.finetune.pending import PendingQuantum
from gpu_runtime.finetune.quantum import (
    QuantumResult,
    StepRecord,
    TrainerRng,
    no_training_result,
    swapped_rng,
)
from gpu_runtime.finetune.schedule import LrSchedule
from gpu_runtime.finetune.sliced import SlicedMicroBatch
from gpu_runtime.finetune.validation import (
    VALID_SAMPLE_TOKENS,
    BatchEvaluator,
    CheckpointEvaluation,
    TokenLossEvaluator,
    ValidationRun,
    checkpoint_metrics,
    validation_sample,
)
from gpu_runtime.model import CausalLM


class LoraTrainer(GraphedQuantaMixin):
    """Trains one LoRA adapter over a serving model's shared, frozen base weights."""

    layer_sliced_quanta = True
    """Quanta may be slices of layers (`max_layers`); the co-location loop offers them."""
    trains_preferences = False
    """Trains on preference pairs (DPO): hparams carry ``dpo_beta``, steps have no token
    accuracy."""

    def __init__(
        self,
        serving_model: CausalLM,
        train_examples: Sequence[TokenizedExample],
        hparams: FinetuneHyperparameters,
        *,
        pad_token_id: int = 0,
        pad_to_multiple: int = 8,
        loss_chunk_tokens: int = 2048,
        checkpoint_root: str | Path | None = None,
        base_model_name_or_path: str | None = None,
        fused_forward: bool = True,
        cuda_graphs: bool | None = None,
        max_cuda_graphs: int = 32,
        validation_examples: Sequence[TokenizedExample] = (),
        valid_sample_tokens: int = VALID_SAMPLE_TOKENS,
    ) -> None:
        """``checkpoint_root``: where automatic checkpoints go (none when None);
        ``base_model_name_or_path`` is recorded in each adapter's config; ``fused_forward``
        selects :class:`FusedTrainingForward` (default) over calling the peft-wrapped tree;
        ``cuda_graphs`` replays captured micro-batches (None: on CUDA, unless recomputation is
        on without the fused forward, whose peft layers' checkpoint reads the CUDA RNG state,
        which a capture forbids; True elsewhere records why each quantum ran eagerly), keeping
        at most ``max_cuda_graphs`` shapes captured (:class:`CapturePolicy`);
        ``validation_examples`` (a validation file) are evaluated at every checkpoint, a fixed
        sample of at most ``valid_sample_tokens`` tokens each time and all of them at the last
        (:func:`~gpu_runtime.finetune.validation.checkpoint_metrics`)."""
        if hparams.dpo_beta is not None and not self.trains_preferences:
            raise ValueError("dpo_beta is set: a DPO job trains with DpoTrainer")
        self.hparams = hparams
        self.checkpoint_root = None if checkpoint_root is None else Path(checkpoint_root)
        self.base_model_name_or_path = base_model_name_or_path
        self.device = serving_model.lm_head.weight.device
        self.model = build_training_model(serving_model, hparams.lora, hparams.seed)
        self.params = adapter_parameters(self.model)
        self._fused = FusedTrainingForward(self.model, serving_model) if fused_forward else None
        self.stream = DataStream(train_examples, hparams.batch_size, hparams.n_epochs, hparams.seed)
        self.schedule = LrSchedule.from_ratio(
            hparams.learning_rate,
            self.stream.total_optimizer_steps,
            hparams.warmup_ratio,
            hparams.lr_schedule,
        )
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=self.schedule.rate(0),
            betas=hparams.adam_betas,
            eps=hparams.adam_eps,
            weight_decay=hparams.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.rng = TrainerRng(hparams.seed, self.device)
        self.pad_token_id = pad_token_id
        self.pad_to_multiple = pad_to_multiple
        self.loss_chunk_tokens = loss_chunk_tokens
        self.step = 0
        self.history: list[StepRecord] = []
        self._batch_loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self._batch_correct = torch.zeros((), dtype=torch.float32, device=self.device)
        """Argmax hits of the optimizer batch in progress (token accuracy; the loss adds in
        place, so captured graphs add into this very tensor)."""
        self.validation_examples = tuple(validation_examples)
        self.valid_sample = validation_sample(
            self.validation_examples, valid_sample_tokens, hparams.seed
        )
        self.last_metrics: dict[str, Any] | None = None
        """The metrics of the latest checkpoint written (:meth:`checkpoint_metrics`)."""
        self._evaluation: CheckpointEvaluation | None = None
        """The validation passes of a due checkpoint, run as quanta before it is written."""
        self._batch_tokens = 0
        self._pending: tuple[MicroBatchPlan, MicroBatch, SlicedMicroBatch] | None = None
        self._unread: PendingQuantum | None = None
        self.recompute = hparams.activation_checkpointing
        """Whether a quantum whose call does not say recomputes activations (a finetune side
        that sizes quanta to a memory budget sets it before each launch)."""
        self.recompute_micro_batches = 0
        """Micro-batches completed with recomputation (whole or layer-sliced)."""
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and (
                fused_forward or not hparams.activation_checkpointing
            )
        self.graphs: MicroBatchGraphs | None = None
        if cuda_graphs:
            self.graphs = MicroBatchGraphs(
                self._forward_backward,
                self.params,
                self.rng,
                self.device,
                self._rng_swap,
                CapturePolicy(max_graphs=max_cuda_graphs),
            )

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs so that their memory pool can be freed (call before
        ``torch.cuda.empty_cache()`` when memory must go back to decode); quanta keep running,
        capturing again as shapes recur."""
        if self.graphs is not None:
            self.graphs.release()

    def disable_cuda_graphs(self, reason: str) -> None:
        """Run every later micro-batch eagerly (e.g. after a failed quantum on some stream);
        each result reports ``reason`` as its graph fallback. No-op without graphs."""
        if self.graphs is not None:
            self.graphs.disable(reason)

    @property
    def finished(self) -> bool:
        """Every epoch consumed and the final checkpoint's validation passes done."""
        return self.stream.finished and self._evaluation is None

    @property
    def evaluating(self) -> bool:
        """Whether the next quanta run a due checkpoint's validation passes."""
        return self._evaluation is not None

    @property
    def total_steps(self) -> int:
        return self.stream.total_optimizer_steps

    @property
    def has_pending_gradients(self) -> bool:
        """True between the first micro-batch of a batch and its optimizer step."""
        return self._batch_tokens > 0 or self._pending is not None

    def restore_progress(self, step: int, history: Sequence[dict[str, float]]) -> None:
        """Set the step count and loss history (used by checkpoint loading)."""
        if self.has_pending_gradients:
            raise RuntimeError("cannot restore progress while a batch is half accumulated")
        self.step = step
        self.history = [
            StepRecord(
                step=int(h["step"]),
                loss=float(h["loss"]),
                learning_rate=float(h["learning_rate"]),
                grad_norm=float(h["grad_norm"]),
                tokens=int(h["tokens"]),
                accuracy=None if h.get("accuracy") is None else float(h["accuracy"]),
            )
            for h in history
        ]

    def _autocast(self) -> torch.autocast:
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"
        )

    def _loss_sum(self, batch: MicroBatch, correct_out: torch.Tensor | None = None) -> torch.Tensor:
        """Summed token loss of ``batch`` (validation: no backward, nothing to recompute);
        argmax hits are added to ``correct_out`` when given."""
        b = batch
        return self._loss_of(
            b.input_ids, b.positions, b.loss_positions, b.loss_targets, False, correct_out
        )

    def _loss_of(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        loss_positions: torch.Tensor,
        loss_targets: torch.Tensor,
        recompute: bool,
        correct_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Summed token loss (fp32 scalar); inputs ``[B, S]``, loss positions/targets ``[N]``;
        argmax hits are added to ``correct_out`` when given."""
        with self._autocast():
            if self._fused is not None:
                hidden = self._fused(input_ids, positions, recompute)
            else:
                hidden = training_hidden_states(self.model, input_ids, positions, recompute)
            return chunked_lm_head_loss(
                self.model,
                hidden,
                loss_positions,
                loss_targets,
                self.loss_chunk_tokens,
                correct_out,
            )

    def _forward_backward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        loss_positions: torch.Tensor,
        loss_targets: torch.Tensor,
        denominator: int | torch.Tensor,
        recompute: bool,
    ) -> torch.Tensor:
        """Summed loss; adds the gradients of ``loss_sum / denominator`` to ``.grad`` (graphs
        pass the denominator as a device scalar: the same fp32 division)."""
        loss_sum = self._loss_of(
            input_ids, positions, loss_positions, loss_targets, recompute, self._batch_correct
        )
        (loss_sum / denominator).backward()
        return loss_sum

    def _chunked_loss(self, batch: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
        return chunked_lm_head_loss(
            self.model,
            hidden,
            batch.loss_positions,
            batch.loss_targets,
            self.loss_chunk_tokens,
            self._batch_correct,
        )

    def _prepare(self, examples: Sequence[TokenizedExample]) -> MicroBatch:
        batch = collate(examples, self.pad_token_id, self.pad_to_multiple)
        return batch.to(self.device)

    def _rng_swap(self) -> contextlib.AbstractContextManager[None]:
        return swapped_rng(self.rng)

    def _begin_quantum(self) -> tuple[float, int]:
        """(start time, bytes allocated) of a quantum starting now; refuses to start while a
        launched quantum's result is unread, resets the peak-memory count, sets train mode."""
        unread = self._unread
        if unread is not None:
            if not unread.is_read:
                raise RuntimeError("the previous quantum's result has not been read yet")
            self._unread = None
        start = time.perf_counter()
        allocated = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
        if not self.model.training:
            self.model.train()
        return start, allocated

    def step_quantum(
        self,
        max_tokens: int | None = None,
        max_examples: int | None = None,
        max_layers: int | None = None,
        recompute: bool | None = None,
    ) -> QuantumResult:
        """One bounded unit of training (see the module docstring). Raises once finished.

        ``max_layers=None``: a whole micro-batch (forward and backward). ``max_layers=k``: up to
        ``k`` decoder-layer passes of the micro-batch in progress (starting one if none is);
        ``max_tokens``/``max_examples``/``recompute`` size a micro-batch when one starts (a
        layer-sliced one keeps the mode it started with).
        """
        if self._evaluation is not None:
            return self._evaluation.quantum(max_tokens)
        start, allocated = self._begin_quantum()
        mode = self._recompute(recompute)
        if max_layers is None and self._pending is None:
            if self.graphs is not None:
                with self.graphs.on_stream():
                    launched = self._graphed_micro_batch(
                        max_examples, max_tokens, mode, start, allocated, False
                    )
                return launched.result()
            plan = self.stream.plan(max_examples, max_tokens, self.pad_to_multiple)
            batch = self._prepare([self.stream.examples[i] for i in plan.example_indices])
            launch = time.perf_counter()
            with self._rng_swap():
                loss_sum = self._forward_backward(
                    batch.input_ids,
                    batch.positions,
                    batch.loss_positions,
                    batch.loss_targets,
                    plan.batch_loss_tokens,
                    mode,
                )
            launch_s = time.perf_counter() - launch
            tail = self._launch_tail(
                plan, batch, loss_sum, start, 0, launch_s=launch_s, recompute=mode
            )
            return tail.result()
        if self._pending is None:
            plan = self.stream.plan(max_examples, max_tokens, self.pad_to_multiple)
            batch = self._prepare([self.stream.examples[i] for i in plan.example_indices])
            stack = self._fused if self._fused is not None else PeftTreeStack(self.model)
            sliced = SlicedMicroBatch(
                stack,
                batch.input_ids,
                batch.positions,
                functools.partial(self._chunked_loss, batch),
                plan.batch_loss_tokens,
                mode,
            )
            self._pending = (plan, batch, sliced)
        plan, batch, sliced = self._pending
        budget = max_layers if max_layers is not None else sliced.total_layer_passes
        with self._rng_swap(), self._autocast():
            passes = sliced.advance(budget)
        if not sliced.done:
            host_s = time.perf_counter() - start
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return no_training_result(
                step=self.step,
                position=self.stream.position,
                finished=False,
                wall_s=time.perf_counter() - start,
                peak=self._peak(),
                layer_passes=passes,
                micro_batch_done=False,
                host_s=host_s,
                **self._sliced_graph_fields(),
            )
        self._pending = None
        assert sliced.loss_sum is not None
        tail = self._launch_tail(
            plan,
            batch,
            sliced.loss_sum,
            start,
            passes,
            recompute=sliced.checkpointing,
            **self._sliced_graph_fields(),
        )
        return tail.result()

    def _sliced_graph_fields(self) -> dict[str, Any]:
        if self.graphs is None:
            return {}
        return {"graph": "eager", "graph_fallback": "layer-sliced quanta run eagerly"}

    def validation_evaluator(self) -> BatchEvaluator:
        """How this trainer evaluates a validation micro-batch: token loss and accuracy."""
        return TokenLossEvaluator(self)

    def validation(
        self, examples: Sequence[TokenizedExample], max_tokens: int = 8192
    ) -> ValidationRun:
        """A validation pass the scheduler can run a micro-batch at a time (see
        :class:`ValidationRun`)."""
        return ValidationRun(self, examples, max_tokens)

    def evaluate(self, examples: Sequence[TokenizedExample], max_tokens: int = 8192) -> float:
        """Mean validation loss of ``examples`` (a validation file) with the current adapter, in
        one call (:meth:`validation_evaluator`'s loss). Leaves the trainer's state (data
        position, RNG, gradients) untouched."""
        run = self.validation(examples, max_tokens)
        while not run.step():
            pass
        return run.loss

    def _checkpoint_due(self, *, final: bool) -> Path | None:
        """A checkpoint is due after this optimizer step: with a validation file its passes
        become the next quanta (:meth:`_evaluation_quantum` writes it); without, its metrics
        are the step's own and it is written now (when there is a checkpoint root)."""
        if self.validation_examples:
            self._evaluation = CheckpointEvaluation(self, final=final)
            return None
        self.checkpoint_metrics(final=final)
        return self._write_checkpoint()

    def _write_checkpoint(self) -> Path | None:
        if self.checkpoint_root is None:
            return None
        return save_checkpoint(self, self.checkpoint_root, self.base_model_name_or_path)

    def _evaluated(self, metrics: dict[str, Any]) -> Path | None:
        """The due checkpoint's validation passes are done: keep their metrics, write it."""
        self._evaluation = None
        self.last_metrics = metrics
        return self._write_checkpoint()

    def checkpoint_metrics(self, *, final: bool) -> dict[str, Any]:
        """OpenAI's checkpoint metrics at the current step, kept as :attr:`last_metrics`
        (see :func:`~gpu_runtime.finetune.validation.checkpoint_metrics`)."""
        self.last_metrics = checkpoint_metrics(self, final=final)
        return self.last_metrics
