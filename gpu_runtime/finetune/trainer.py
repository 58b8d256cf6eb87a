"""LoRA trainer that advances in bounded quanta a scheduler can interleave with decode.

``LoraTrainer.step_quantum(max_tokens=..., max_examples=...)`` runs one micro-batch (forward and
backward) of at most that many padded tokens / examples, never crossing an optimizer-batch
boundary; the micro-batch that completes the job's batch also clips, steps AdamW and advances
the learning-rate schedule. ``recompute`` picks activation recomputation per micro-batch
(default: :attr:`LoraTrainer.recompute`; the same gradients, much less memory). With
``max_layers=k`` a quantum is ``k`` decoder-layer passes of the micro-batch in progress, with
identical results. Training does not depend on how quanta were sized: each micro-batch's summed
token loss is divided by its whole optimizer batch's loss-token count. One host sync per
quantum (reading loss and grad norm) is the agreed sync point. On CUDA, whole micro-batches
replay CUDA graphs by default (``cuda_graphs=False`` turns them off); each
:class:`QuantumResult` says how its quantum ran. Dropout draws from the trainer's own
generators (:class:`TrainerRng`), so decode sampling beside it neither disturbs nor is disturbed
and a resumed run draws the same masks.

The trainer builds its parts and routes each quantum to one of them; each part has its own
inputs and none holds the trainer: the micro-batch's loss
(:class:`~gpu_runtime.finetune.supervised_loss.SupervisedLoss`), the graphed launches
(:class:`~gpu_runtime.finetune.graphed.GraphedQuanta`), the layer-sliced micro-batch in progress
(:class:`~gpu_runtime.finetune.sliced_quanta.LayerSlicedQuanta`) and the end every quantum
shares: accumulation, optimizer step, step count and history
(:class:`~gpu_runtime.finetune.tail.OptimizerTail`), and the checkpoints with their validation
passes (:class:`~gpu_runtime.finetune.checkpointing.Checkpointing`). The package README states
the whole quantum contract and the checkpoint invariants.

Over a tensor-parallel rank's shard every rank builds the same trainer and runs the same quanta;
its tree's collectives use the finetune communicator, its tail sums the shared gradients and
clips by the global norm (:class:`~gpu_runtime.finetune.sharded_gradients.ShardedGradients`),
and checkpoints are gathered whole (README, "Tensor parallelism").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.contract.hparams import FinetuneHyperparameters
from gpu_runtime.finetune.batching import DataStream
from gpu_runtime.finetune.checkpointing import Checkpointing
from gpu_runtime.finetune.data import TokenizedExample
from gpu_runtime.finetune.fused_forward import FusedTrainingForward
from gpu_runtime.finetune.graph_policy import CapturePolicy
from gpu_runtime.finetune.graphed import GraphedQuanta
from gpu_runtime.finetune.graphs import MicroBatchGraphs
from gpu_runtime.finetune.lora import (
    adapter_parameter_names,
    adapter_parameters,
    build_training_model,
)
from gpu_runtime.finetune.pending import PendingQuantum
from gpu_runtime.finetune.quantum import (
    QuantumResult,
    StepRecord,
    TrainerRng,
    swapped_rng,
)
from gpu_runtime.finetune.sharded_gradients import ShardedGradients
from gpu_runtime.finetune.sliced_quanta import LayerSlicedQuanta
from gpu_runtime.finetune.supervised_loss import SupervisedLoss
from gpu_runtime.finetune.tail import OptimizerTail
from gpu_runtime.finetune.validation import VALID_SAMPLE_TOKENS, TokenLossEvaluator
from gpu_runtime.model import CausalLM


class LoraTrainer:
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
        (:mod:`gpu_runtime.finetune.validation`)."""
        if hparams.dpo_beta is not None and not self.trains_preferences:
            raise ValueError("dpo_beta is set: a DPO job trains with DpoTrainer")
        self.hparams = hparams
        self.device = serving_model.lm_head.weight.device
        self.model = build_training_model(serving_model, hparams.lora, hparams.seed)
        self.params = adapter_parameters(self.model)
        gradients = None
        if self.model.parallel.size > 1:
            named = zip(adapter_parameter_names(self.model), self.params, strict=True)
            gradients = ShardedGradients(self.model.parallel, self.model.shard, list(named))
        fused = FusedTrainingForward(self.model, serving_model) if fused_forward else None
        self.stream = DataStream(train_examples, hparams.batch_size, hparams.n_epochs, hparams.seed)
        self.rng = TrainerRng(hparams.seed, self.device)
        self.optimizer_tail = OptimizerTail(
            hparams,
            self.stream,
            self.params,
            self.device,
            token_accuracy=not self.trains_preferences,
            gradients=gradients,
        )
        self.optimizer, self.schedule = self.optimizer_tail.optimizer, self.optimizer_tail.schedule
        self.token_loss = SupervisedLoss(
            self.model,
            fused,
            self.optimizer_tail.batch_correct,
            pad_token_id=pad_token_id,
            pad_to_multiple=pad_to_multiple,
            loss_chunk_tokens=loss_chunk_tokens,
        )
        self.checkpoints = Checkpointing(
            TokenLossEvaluator(self.token_loss),
            self.model,
            self.device,
            self.optimizer_tail,
            validation_examples,
            valid_sample_tokens=valid_sample_tokens,
            seed=hparams.seed,
            root=None if checkpoint_root is None else Path(checkpoint_root),
            base_model_name_or_path=base_model_name_or_path,
        )
        self.layer_slices = LayerSlicedQuanta(
            self.stream, self.token_loss, self.optimizer_tail, self.rng
        )
        self._unread: PendingQuantum | None = None
        self.recompute = hparams.activation_checkpointing
        """Whether a quantum whose call does not say recomputes activations (a finetune side
        that sizes quanta to a memory budget sets it before each launch)."""
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and (
                fused_forward or not hparams.activation_checkpointing
            )
        self._graphed: GraphedQuanta | None = None
        if cuda_graphs:
            self.graphs = MicroBatchGraphs(
                self.token_loss.forward_backward,
                self.params,
                self.rng,
                self.device,
                self._rng_swap,
                CapturePolicy(max_graphs=max_cuda_graphs),
            )

    @property
    def graphs(self) -> MicroBatchGraphs | None:
        """The captured micro-batch graphs (None: every micro-batch runs eagerly)."""
        return None if self._graphed is None else self._graphed.graphs

    @graphs.setter
    def graphs(self, graphs: MicroBatchGraphs | None) -> None:
        """Run whole micro-batches through ``graphs`` (set before the first quantum)."""
        self._graphed = None
        if graphs is not None:
            pad_token_id = self.token_loss.pad_token_id
            self._graphed = GraphedQuanta(graphs, self.stream, pad_token_id, self.optimizer_tail)
        self.optimizer_tail.keep_grad_tensors = graphs is not None

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
    def step(self) -> int:
        """Optimizer steps done."""
        return self.optimizer_tail.step

    @property
    def history(self) -> list[StepRecord]:
        """One record per optimizer step (the loss curve)."""
        return self.optimizer_tail.history

    @property
    def recompute_micro_batches(self) -> int:
        """Micro-batches completed with recomputation (whole or layer-sliced)."""
        return self.optimizer_tail.recompute_micro_batches

    @property
    def finished(self) -> bool:
        """Every epoch consumed and the final checkpoint's validation passes done."""
        return self.stream.finished and not self.checkpoints.evaluating

    @property
    def evaluating(self) -> bool:
        """Whether the next quanta run a due checkpoint's validation passes."""
        return self.checkpoints.evaluating

    @property
    def total_steps(self) -> int:
        return self.stream.total_optimizer_steps

    @property
    def has_pending_gradients(self) -> bool:
        """True between the first micro-batch of a batch and its optimizer step."""
        return self.optimizer_tail.batch_tokens > 0 or self.layer_slices.in_progress

    def _rng_swap(self) -> contextlib.AbstractContextManager[None]:
        return swapped_rng(self.rng)

    def _recompute(self, recompute: bool | None) -> bool:
        return self.recompute if recompute is None else recompute

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
        if self.evaluating:
            return self._evaluation_quantum(max_tokens)
        start, allocated = self._begin_quantum()
        mode = self._recompute(recompute)
        if max_layers is not None or self.layer_slices.in_progress:
            graph: dict[str, Any] = {}
            if self.graphs is not None:
                graph = {"graph": "eager", "graph_fallback": "layer-sliced quanta run eagerly"}
            return self.layer_slices.advance(
                max_examples, max_tokens, max_layers, mode, start, self, graph
            )
        if self._graphed is not None:
            launched = self._graphed.launch(
                max_examples, max_tokens, mode, start, allocated, False, self
            )
            return launched.result()
        plan = self.stream.plan(max_examples, max_tokens, self.token_loss.pad_to_multiple)
        batch = self.token_loss.prepare([self.stream.examples[i] for i in plan.example_indices])
        launch = time.perf_counter()
        with self._rng_swap():
            loss_sum = self.token_loss.forward_backward(
                batch.input_ids,
                batch.positions,
                batch.loss_positions,
                batch.loss_targets,
                plan.batch_loss_tokens,
                mode,
            )
        launch_s = time.perf_counter() - launch
        tail = self.optimizer_tail.launch(
            plan, batch, loss_sum, start, self, launch_s=launch_s, recompute=mode
        )
        return tail.result()

    def start_quantum(
        self,
        max_tokens: int | None = None,
        max_examples: int | None = None,
        recompute: bool | None = None,
    ) -> PendingQuantum:
        """A whole micro-batch like ``step_quantum``, launched without waiting for the GPU.

        With CUDA graphs (and no layer-sliced micro-batch in progress) this only issues the
        graph replay and the optimizer step on the current stream and returns; the caller polls
        :meth:`PendingQuantum.done` and reads :meth:`PendingQuantum.result` (its ``gpu_ms`` is
        the quantum's time on the stream). Anything else runs to its end here and comes back
        done. No other quantum starts until that result has been read (RuntimeError)."""
        graphed = self._graphed
        if (
            graphed is None
            or self.layer_slices.in_progress
            or self.device.type != "cuda"
            or self.evaluating
        ):
            return PendingQuantum.finished(
                self.step_quantum(max_tokens, max_examples, recompute=recompute)
            )
        start, allocated = self._begin_quantum()
        mode = self._recompute(recompute)
        launched = graphed.launch(max_examples, max_tokens, mode, start, allocated, True, self)
        if not launched.done():
            self._unread = launched
        return launched

    def replays_next(
        self, max_tokens: int | None, streams: Iterable[int], recompute: bool | None = None
    ) -> dict[int, bool] | None:
        """Per CUDA stream handle in ``streams``: whether the next whole micro-batch of at most
        ``max_tokens`` tokens, launched from this thread on that stream, would replay a
        captured graph (True) or first warm up or be captured, a one-off stall of the launching
        thread (False); None: the job does not run graphs. Nothing changes."""
        graphed = self._graphed
        if graphed is None or graphed.graphs.disabled is not None:
            return None
        if self.finished or self.evaluating:
            return None
        return graphed.would_replay(max_tokens, streams, self._recompute(recompute))

    def checkpoint_due(self, *, final: bool) -> Path | None:
        """An optimizer step made a checkpoint due (the tail calls this when the step's result
        is read): :meth:`Checkpointing.due` over this trainer's state."""
        return self.checkpoints.due(self, final=final)

    def _evaluation_quantum(self, max_tokens: int | None) -> QuantumResult:
        """A quantum of the due checkpoint's validation passes
        (:meth:`Checkpointing.evaluation_quantum`)."""
        start, _ = self._begin_quantum()
        graphed = self.graphs is not None
        return self.checkpoints.evaluation_quantum(self, max_tokens, start, graphed=graphed)
