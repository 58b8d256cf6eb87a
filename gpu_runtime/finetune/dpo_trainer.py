"""DPO on a LoRA adapter, in the same bounded quanta as supervised training.

:class:`DpoTrainer` is a :class:`~gpu_runtime.finetune.trainer.LoraTrainer` whose examples are
preference pairs (:class:`~gpu_runtime.finetune.preference_data.PreferencePair`) and whose loss
is DPO's (:mod:`gpu_runtime.finetune.dpo`), so a co-location loop drives it exactly like a
supervised job: ``step_quantum(max_tokens=..., max_examples=...)`` runs one micro-batch of
pairs (its preferred rows, then its other rows, in one ``[2n, S]`` batch), never crossing an
optimizer-batch boundary; ``max_tokens`` bounds the padded tokens of both rows. Each micro-batch
first runs the reference pass (the same weights with the adapter off, eval mode, no gradient),
then the policy's forward and backward; the batch loss is the mean over its pairs, whatever the
micro-batch sizes. Data order, checkpoints, exact resume and the optimizer step are the
supervised trainer's.

Validation pairs (a preference validation file) are evaluated at every checkpoint exactly as a
supervised trainer's examples (:mod:`gpu_runtime.finetune.validation`: a seeded sample at each,
all of them at the last, in bounded quanta, eval mode, no gradient), with DPO's loss
(:class:`DpoValidationEvaluator`): ``valid_loss`` is the mean DPO loss over the pairs (policy:
the adapter on; reference: the adapter off) and ``valid_preference_accuracy`` the fraction of
pairs ranked right; the token-accuracy fields stay null.

What a micro-batch of pairs computes is :class:`PreferenceLoss`'s (built over the trainer's
:class:`~gpu_runtime.finetune.supervised_loss.SupervisedLoss`, whose forward and collation it
reuses); the trainer's quanta, optimizer tail and checkpoints are the supervised trainer's.
Whole micro-batches only, run eagerly: no CUDA graphs and no layer-sliced quanta
(:attr:`DpoTrainer.layer_sliced_quanta` tells the loop, which then never asks for them).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from gpu_runtime.contract.hparams import FinetuneHyperparameters
from gpu_runtime.finetune.batching import MicroBatch
from gpu_runtime.finetune.data import TokenizedExample
from gpu_runtime.finetune.dpo import (
    DpoTerms,
    PreferenceRecord,
    adapters_disabled,
    dpo_terms,
    sequence_logprobs,
    tuner_layers,
)
from gpu_runtime.finetune.preference_data import PreferencePair
from gpu_runtime.finetune.quantum import QuantumResult, swapped_rng
from gpu_runtime.finetune.supervised_loss import SupervisedLoss
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.finetune.validation import VALID_SAMPLE_TOKENS
from gpu_runtime.model import CausalLM


class PreferenceLoss:
    """DPO's terms of a micro-batch of pairs: the policy's summed completion log-probabilities
    (the adapter on) against the reference's (the adapter off, eval mode, no gradient)."""

    def __init__(
        self, token_loss: SupervisedLoss, params: Sequence[torch.nn.Parameter], beta: float
    ) -> None:
        """``token_loss``: the training tree's forward and collation; ``params``: its adapter
        parameters (switched off for the reference)."""
        self.token_loss = token_loss
        self.params = list(params)
        self.beta = beta
        self._tuner_layers = tuner_layers(token_loss.model)

    def pair_batch(self, pairs: Sequence[PreferencePair]) -> MicroBatch:
        """The ``[2n, S]`` micro-batch of ``pairs``: preferred rows, then the other rows."""
        rows = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        return self.token_loss.prepare(rows)

    def logprobs(self, batch: MicroBatch, recompute: bool) -> torch.Tensor:
        """Summed completion log-probabilities ``[rows]`` of the training tree as it is."""
        loss = self.token_loss
        with loss.autocast():
            hidden = loss.hidden(batch.input_ids, batch.positions, recompute)
            return sequence_logprobs(
                loss.model, hidden, batch.loss_positions, batch.loss_targets, loss.loss_chunk_tokens
            )

    @torch.no_grad()
    def reference_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        """Summed completion log-probabilities ``[rows]`` under the base model (the adapter
        off, eval mode, no gradient); the model's mode is restored after."""
        model = self.token_loss.model
        training = model.training
        model.eval()
        try:
            with adapters_disabled(self._tuner_layers, self.params, self.token_loss.fused):
                return self.logprobs(batch, False)
        finally:
            model.train(training)

    def terms(self, batch: MicroBatch, reference: torch.Tensor, recompute: bool) -> DpoTerms:
        """DPO's loss terms of ``batch`` against its ``reference`` log-probabilities."""
        return dpo_terms(self.logprobs(batch, recompute), reference, self.beta)


class DpoTrainer(LoraTrainer):
    """Trains one LoRA adapter with DPO over a serving model's shared, frozen base weights."""

    layer_sliced_quanta = False
    """Quanta are whole micro-batches (the co-location loop offers no layer slices)."""
    trains_preferences = True
    """Its hparams carry ``dpo_beta`` (a plain ``LoraTrainer`` refuses them)."""

    def __init__(
        self,
        serving_model: CausalLM,
        train_pairs: Sequence[PreferencePair],
        hparams: FinetuneHyperparameters,
        *,
        pad_token_id: int = 0,
        pad_to_multiple: int = 8,
        loss_chunk_tokens: int = 2048,
        checkpoint_root: str | Path | None = None,
        base_model_name_or_path: str | None = None,
        fused_forward: bool = True,
        validation_pairs: Sequence[PreferencePair] = (),
        valid_sample_tokens: int = VALID_SAMPLE_TOKENS,
    ) -> None:
        """As :class:`LoraTrainer`'s; ``validation_pairs`` are its ``validation_examples``
        (evaluated with DPO's loss, see the module docstring)."""
        if hparams.dpo_beta is None:
            raise ValueError("a DPO trainer needs hparams.dpo_beta")
        # The data stream reads only num_tokens and num_loss_tokens, which a pair has.
        super().__init__(
            serving_model,
            cast("Sequence[TokenizedExample]", train_pairs),
            hparams,
            pad_token_id=pad_token_id,
            pad_to_multiple=pad_to_multiple,
            loss_chunk_tokens=loss_chunk_tokens,
            checkpoint_root=checkpoint_root,
            base_model_name_or_path=base_model_name_or_path,
            fused_forward=fused_forward,
            cuda_graphs=False,
            validation_examples=cast("Sequence[TokenizedExample]", validation_pairs),
            valid_sample_tokens=valid_sample_tokens,
        )
        self.beta = float(hparams.dpo_beta)
        self.pairs: tuple[PreferencePair, ...] = tuple(train_pairs)
        self.preference_history: list[PreferenceRecord] = []
        self.preference_loss = PreferenceLoss(self.token_loss, self.params, self.beta)
        self._batch_stats = torch.zeros(3, dtype=torch.float32, device=self.device)
        self.checkpoints.evaluator = DpoValidationEvaluator(self.preference_loss)

    def restore_preference_history(self, history: Sequence[dict[str, float]]) -> None:
        """Set the per-step preference metrics (used by checkpoint loading)."""
        self.preference_history = [
            PreferenceRecord(
                step=int(h["step"]),
                accuracy=float(h["accuracy"]),
                chosen_reward=float(h["chosen_reward"]),
                rejected_reward=float(h["rejected_reward"]),
            )
            for h in history
        ]

    def _pair_padded(self, length: int) -> int:
        """Padded tokens of a pair whose ``num_tokens`` is ``length`` (two rows of half)."""
        row, multiple = length // 2, self.token_loss.pad_to_multiple
        return 2 * (-(-row // multiple) * multiple)

    def step_quantum(
        self,
        max_tokens: int | None = None,
        max_examples: int | None = None,
        max_layers: int | None = None,
        recompute: bool | None = None,
    ) -> QuantumResult:
        """One micro-batch of at most ``max_examples`` pairs and ``max_tokens`` padded tokens
        (see the module docstring). Raises once finished, and for ``max_layers``."""
        if max_layers is not None:
            raise ValueError("DPO quanta are whole micro-batches; max_layers is not supported")
        if self.evaluating:
            return self._evaluation_quantum(max_tokens)
        start, _ = self._begin_quantum()
        mode = self._recompute(recompute)
        plan = self.stream.plan(max_examples, max_tokens, padded_length=self._pair_padded)
        pairs = [self.pairs[i] for i in plan.example_indices]
        loss = self.preference_loss
        batch = loss.pair_batch(pairs)
        launch = time.perf_counter()
        reference = loss.reference_logprobs(batch)
        with swapped_rng(self.rng):
            terms = loss.terms(batch, reference, mode)
            (terms.loss_sum / plan.batch_loss_tokens).backward()
        launch_s = time.perf_counter() - launch
        self._batch_stats += terms.stats
        if plan.completes_batch:
            # before the tail: a checkpoint it writes holds this step's record
            pairs_in_batch = plan.batch_loss_tokens
            correct, chosen, rejected = (v / pairs_in_batch for v in self._batch_stats.tolist())
            self.preference_history.append(
                PreferenceRecord(self.step + 1, correct, chosen, rejected)
            )
            self._batch_stats.zero_()
        # the tail reports the mean over pairs: one loss term per pair
        per_pair = dataclasses.replace(batch, num_loss_tokens=len(pairs))
        tail = self.optimizer_tail.launch(
            plan, per_pair, terms.loss_sum, start, self, launch_s=launch_s, recompute=mode
        )
        return tail.result()


class DpoValidationEvaluator:
    """A DPO trainer's validation micro-batch of pairs: summed DPO loss (the policy with the
    adapter on, the reference with it off; no gradient, the caller's eval mode), pairs ranked
    right, and the pair count."""

    accuracy_key = "preference_accuracy"

    def __init__(self, loss: PreferenceLoss) -> None:
        self.loss = loss

    def __call__(self, items: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        batch = self.loss.pair_batch(items)
        terms = self.loss.terms(batch, self.loss.reference_logprobs(batch), False)
        return terms.loss_sum, terms.stats[0], len(items)
