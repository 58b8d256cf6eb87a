"""What a supervised trainer computes on one micro-batch: its summed token loss through the
training tree, and the forward-backward a quantum (or a captured CUDA graph) runs.

:class:`SupervisedLoss` runs the training tree's forward (the fused forward,
:class:`~gpu_runtime.finetune.fused_forward.FusedTrainingForward`, or the peft-wrapped tree,
:func:`~gpu_runtime.finetune.loss.training_hidden_states`) under bf16 autocast on CUDA, then the
chunked LM-head cross-entropy (:func:`~gpu_runtime.finetune.loss.chunked_lm_head_loss`). The
training forward adds the argmax hits of its loss targets into :attr:`SupervisedLoss.hits` in
place (the optimizer batch's token accuracy: a captured graph adds into that very tensor on
every replay); validation passes its own counter. It holds no optimizer or data state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_runtime.finetune.batching import MicroBatch, collate
from gpu_runtime.finetune.data import TokenizedExample
from gpu_runtime.finetune.fused_forward import FusedTrainingForward
from gpu_runtime.finetune.loss import PeftTreeStack, chunked_lm_head_loss, training_hidden_states
from gpu_runtime.finetune.sliced import LayerStack
from gpu_runtime.model import CausalLM


class SupervisedLoss:
    """Summed token loss of a micro-batch through one training tree (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        fused: FusedTrainingForward | None,
        hits: torch.Tensor,
        *,
        pad_token_id: int,
        pad_to_multiple: int,
        loss_chunk_tokens: int,
    ) -> None:
        """``model``: the peft-wrapped training tree; ``fused``: its fused forward (None: call the
        tree); ``hits``: the fp32 device scalar training forwards add argmax hits into;
        micro-batches are right-padded with ``pad_token_id`` to a multiple of
        ``pad_to_multiple``; the LM head runs ``loss_chunk_tokens`` positions at a time."""
        self.model = model
        self.fused = fused
        self.hits = hits
        self.device = hits.device
        self.pad_token_id = pad_token_id
        self.pad_to_multiple = pad_to_multiple
        self.loss_chunk_tokens = loss_chunk_tokens

    def autocast(self) -> torch.autocast:
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"
        )

    def prepare(self, examples: Sequence[TokenizedExample]) -> MicroBatch:
        """The micro-batch of ``examples``, padded and on the device."""
        batch = collate(examples, self.pad_token_id, self.pad_to_multiple)
        return batch.to(self.device)

    def layer_stack(self) -> LayerStack:
        """The training forward by layer ranges (layer-sliced quanta)."""
        return self.fused if self.fused is not None else PeftTreeStack(self.model)

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, recompute: bool
    ) -> torch.Tensor:
        """Final hidden states ``[B, S, H]`` of the training tree (call under :meth:`autocast`)."""
        if self.fused is not None:
            return self.fused(input_ids, positions, recompute)
        return training_hidden_states(self.model, input_ids, positions, recompute)

    def loss_of(
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
        with self.autocast():
            hidden = self.hidden(input_ids, positions, recompute)
            return chunked_lm_head_loss(
                self.model,
                hidden,
                loss_positions,
                loss_targets,
                self.loss_chunk_tokens,
                correct_out,
            )

    def loss_sum(self, batch: MicroBatch, correct_out: torch.Tensor | None = None) -> torch.Tensor:
        """Summed token loss of ``batch`` (validation: no backward, nothing to recompute);
        argmax hits are added to ``correct_out`` when given."""
        b = batch
        return self.loss_of(
            b.input_ids, b.positions, b.loss_positions, b.loss_targets, False, correct_out
        )

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        loss_positions: torch.Tensor,
        loss_targets: torch.Tensor,
        denominator: int | torch.Tensor,
        recompute: bool,
    ) -> torch.Tensor:
        """Summed loss; adds the gradients of ``loss_sum / denominator`` to ``.grad`` and the
        argmax hits to :attr:`hits` (graphs pass the denominator as a device scalar: the same
        fp32 division)."""
        loss_sum = self.loss_of(
            input_ids, positions, loss_positions, loss_targets, recompute, self.hits
        )
        (loss_sum / denominator).backward()
        return loss_sum

    def chunked_loss(self, batch: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
        """Summed token loss of ``batch`` from its final hidden states (a layer-sliced
        micro-batch's last forward slice), argmax hits added to :attr:`hits`."""
        return chunked_lm_head_loss(
            self.model,
            hidden,
            batch.loss_positions,
            batch.loss_targets,
            self.loss_chunk_tokens,
            self.hits,
        )
