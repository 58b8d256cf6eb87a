"""DPO's pieces: sequence log-probabilities of completions, the reference pass, the loss.

For a pair (prompt ``x``, preferred completion ``y_c``, other completion ``y_r``) and
``log pi(y | x)`` the sum of the completion tokens' log-probabilities, DPO's loss is

    -logsigmoid(beta * ((log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))))

where ``pi`` is the model with the adapter and ``ref`` the same base weights with the adapter
off (:func:`adapters_disabled`: no second copy of the model). ``beta * (log pi - log ref)`` is
a completion's implicit reward; a pair is ranked right when the preferred completion's reward
is the higher. With ``lora_B = 0`` (step 0) the policy is the reference and the loss is
``log 2`` exactly.

:func:`sequence_logprobs` never materialises ``[B, S, V]`` logits: like
:func:`~gpu_runtime.finetune.loss.chunked_lm_head_loss` it takes the hidden states of the
positions that predict a completion token, ``chunk_tokens`` at a time, and keeps each one's
gradient with respect to its hidden state (each token's log-probability depends on its own
hidden state only, so the backward only scales those rows by the incoming per-token gradient).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer

from gpu_runtime.finetune.fused_forward import FusedTrainingForward
from gpu_runtime.model import CausalLM


def tuner_layers(tree: CausalLM) -> list[BaseTunerLayer]:
    """The tree's peft LoRA layers (what :func:`adapters_disabled` switches off)."""
    return [m for m in tree.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(
    layers: Sequence[BaseTunerLayer],
    params: Sequence[torch.nn.Parameter],
    fused: FusedTrainingForward | None,
) -> Iterator[None]:
    """Run the tree whose LoRA ``layers`` (and trainable ``params``) these are, and its fused
    forward, as the base model: every adapter is bypassed; all is restored on exit."""
    grads = [p.requires_grad for p in params]
    for layer in layers:
        layer.enable_adapters(False)
    if fused is not None:
        fused.adapters_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, grad in zip(params, grads, strict=True):
            param.requires_grad_(grad)  # peft's toggles set requires_grad
        if fused is not None:
            fused.adapters_enabled = True


class _ChunkedTokenCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        chunk_tokens: int,
    ) -> torch.Tensor:
        needs_grad = bool(ctx.needs_input_grad[0])
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden.shape[0])
            with torch.enable_grad():
                piece = hidden[start:end].detach().requires_grad_(needs_grad)
                logits = compute_logits(piece).float()  # [n, V]
                loss = F.cross_entropy(logits, targets[start:end], reduction="none")  # [n]
                if grad_hidden is not None:
                    (grad,) = torch.autograd.grad(loss.sum(), piece)
                    grad_hidden[start:end] = grad
            losses[start:end] = loss.detach()
        if grad_hidden is not None:
            ctx.save_for_backward(grad_hidden)
        return losses

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_hidden,) = ctx.saved_tensors
        scaled = grad_hidden.float() * grad_output.unsqueeze(-1)
        return (scaled.to(grad_hidden.dtype), None, None, None)


def sequence_logprobs(
    tree: CausalLM,
    hidden: torch.Tensor,
    loss_positions: torch.Tensor,
    loss_targets: torch.Tensor,
    chunk_tokens: int = 2048,
) -> torch.Tensor:
    """Per row of ``hidden`` ``[B, S, H]``: the summed log-probability ``[B]`` (fp32) of the
    targets ``loss_targets`` ``[N]`` predicted at ``loss_positions`` ``[N]`` (flat indices
    into ``B * S``), as :func:`~gpu_runtime.finetune.batching.collate` lays them out."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    rows, seq = hidden.shape[0], hidden.shape[1]
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, loss_positions)  # [N, H]
    losses = _ChunkedTokenCrossEntropy.apply(flat, loss_targets, tree.compute_logits, chunk_tokens)
    assert isinstance(losses, torch.Tensor)
    owner = torch.div(loss_positions, seq, rounding_mode="floor")  # [N] row of each target
    # a [B, N] one-hot matmul rather than index_add: deterministic on CUDA (no atomics)
    rows_of = torch.arange(rows, device=hidden.device).unsqueeze(1) == owner.unsqueeze(0)
    return rows_of.float() @ -losses


@dataclass(frozen=True)
class DpoTerms:
    """One micro-batch's DPO loss and statistics (device tensors, not synced)."""

    loss_sum: torch.Tensor
    """Summed per-pair loss (fp32 scalar, with autograd to the policy)."""
    stats: torch.Tensor
    """``[3]``: pairs ranked right, summed preferred reward, summed other reward."""


def dpo_terms(policy_logps: torch.Tensor, reference_logps: torch.Tensor, beta: float) -> DpoTerms:
    """DPO over ``n`` pairs laid out as ``[preferred rows..., other rows...]`` (``[2n]`` each)."""
    chosen, rejected = policy_logps.chunk(2)
    ref_chosen, ref_rejected = reference_logps.detach().chunk(2)
    chosen_reward = beta * (chosen - ref_chosen)
    rejected_reward = beta * (rejected - ref_rejected)
    losses = -F.logsigmoid(chosen_reward - rejected_reward)
    with torch.no_grad():
        stats = torch.stack(
            [
                (chosen_reward > rejected_reward).float().sum(),
                chosen_reward.sum(),
                rejected_reward.sum(),
            ]
        )
    return DpoTerms(loss_sum=losses.sum(), stats=stats)


@dataclass(frozen=True)
class PreferenceRecord:
    """One optimizer step's preference metrics (means over the batch's pairs)."""

    step: int
    accuracy: float
    """Fraction of pairs whose preferred completion got the higher reward."""
    chosen_reward: float
    rejected_reward: float

    @property
    def margin(self) -> float:
        """Mean reward margin: preferred minus other."""
        return self.chosen_reward - self.rejected_reward

    def metrics(self) -> dict[str, float]:
        """The report fields (job progress events and checkpoint metrics)."""
        return {
            "train_preference_accuracy": self.accuracy,
            "train_chosen_reward": self.chosen_reward,
            "train_rejected_reward": self.rejected_reward,
            "train_reward_margin": self.margin,
        }
