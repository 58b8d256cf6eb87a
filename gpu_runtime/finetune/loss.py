"""Training forward pass over the decoder, and a chunked LM-head cross-entropy.

:func:`training_hidden_states` runs the peft-wrapped tree's own decoder (``DecoderStack``) over
``ModuleOps`` with dense causal attention — ``CausalLM.forward``'s computation, so the two are
equal — one :meth:`DecoderStack.layer_output` at a time (:func:`run_layer_range`), so each
decoder layer can be recomputed in backward (activation checkpointing) and the trainer can run
layer ranges. Both training forwards (this one and the fused one) run their layers through
:func:`run_layer_range`.

:func:`chunked_lm_head_loss` never materialises ``[B, S, V]`` logits: it gathers the hidden
states of the positions that have a target (known on the host when the micro-batch is built, so
no device sync), then, ``chunk_tokens`` positions at a time, computes the logits (bf16 under
autocast), the fp32 cross-entropy and its gradient with respect to those hidden states, and
drops the logits. The backward pass then only scales the stored ``[N, hidden]`` gradient. The LM
head is frozen (LoRA never targets it), so no weight gradient is lost. Given ``correct_out`` (a
device scalar), it also adds the number of targets the logits' argmax predicts to it, in place:
the token accuracy costs no extra logits and no sync, and a CUDA graph that captured the call adds
into the same tensor on every replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gpu_runtime.model import CausalLM, DecoderOps, DecoderStack
from gpu_runtime.model.attention import DenseCausalAttention
from gpu_runtime.model.module_ops import ModuleOps

LayerOpsFn = Callable[[int, torch.Tensor], DecoderOps[Any, Any]]
"""``(layer index, stream x [B, S, H]) -> the ops that layer runs with``."""


def run_layer_range(
    stack: DecoderStack,
    layer_ops: LayerOpsFn,
    x: torch.Tensor,
    layers: range,
    activation_checkpointing: bool,
    preserve_rng_state: bool = True,
) -> torch.Tensor:
    """The residual stream after decoder layers ``layers`` of ``stack`` from ``x`` ``[B, S, H]``.

    With ``activation_checkpointing`` (and grad enabled) each layer runs under non-reentrant
    ``torch.utils.checkpoint`` (its input is kept, its activations recomputed in backward);
    ``preserve_rng_state=False`` only for ops that draw no randomness inside the layer."""
    for index in layers:
        ops = layer_ops(index, x)
        if activation_checkpointing and torch.is_grad_enabled():
            out = checkpoint(
                stack.layer_output,
                ops,
                index,
                x,
                use_reentrant=False,
                preserve_rng_state=preserve_rng_state,
            )
            assert isinstance(out, torch.Tensor)
            x = out
        else:
            x = stack.layer_output(ops, index, x)
    return x


def embed(
    tree: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token embeddings ``[B, S, H]`` and RoPE cos/sin for ``positions`` ``[B, S]``."""
    x = tree.model.embed_tokens(input_ids)
    cos, sin = tree.rope_cos_sin(positions, x.dtype)
    return x, cos, sin


def run_layers(
    tree: CausalLM,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layers: range,
    activation_checkpointing: bool,
) -> torch.Tensor:
    """Decoder layers ``layers`` over ``x`` ``[B, S, H]`` with dense causal attention."""
    ops = ModuleOps(cos, sin, DenseCausalAttention())
    return run_layer_range(tree.model, lambda index, x: ops, x, layers, activation_checkpointing)


def training_hidden_states(
    tree: CausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    activation_checkpointing: bool = False,
) -> torch.Tensor:
    """Final-normed hidden states ``[B, S, H]``, as ``CausalLM.forward`` computes them."""
    x, cos, sin = embed(tree, input_ids, positions)
    x = run_layers(tree, x, cos, sin, range(len(tree.model.layers)), activation_checkpointing)
    return tree.model.norm(x)


class PeftTreeStack:
    """The peft-wrapped tree as a layer stack (for layer-sliced quanta without the fused path)."""

    def __init__(self, tree: CausalLM) -> None:
        self.tree = tree

    @property
    def num_layers(self) -> int:
        return len(self.tree.model.layers)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return embed(self.tree, input_ids, positions)

    def run_layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layers: range,
        activation_checkpointing: bool,
    ) -> torch.Tensor:
        return run_layers(self.tree, x, cos, sin, layers, activation_checkpointing)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tree.model.norm(x)
        assert isinstance(out, torch.Tensor)
        return out


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        chunk_tokens: int,
        correct_out: torch.Tensor | None,
    ) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden.shape[0])
            with torch.enable_grad():
                piece = hidden[start:end].detach().requires_grad_(True)
                logits = compute_logits(piece).float()  # [n, V]
                loss = F.cross_entropy(logits, targets[start:end], reduction="sum")
                (grad,) = torch.autograd.grad(loss, piece)
            grad_hidden[start:end] = grad
            total += loss.detach()
            if correct_out is not None:
                hits = logits.detach().argmax(dim=-1) == targets[start:end]
                correct_out += hits.sum().to(correct_out.dtype)
        ctx.save_for_backward(grad_hidden)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_hidden,) = ctx.saved_tensors
        # scale in fp32: 1/denominator is not exact in bf16
        return ((grad_hidden.float() * grad_output).to(grad_hidden.dtype), None, None, None, None)


def chunked_lm_head_loss(
    tree: CausalLM,
    hidden: torch.Tensor,
    loss_positions: torch.Tensor,
    loss_targets: torch.Tensor,
    chunk_tokens: int = 2048,
    correct_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed token cross-entropy (fp32 scalar) of the predictions at ``loss_positions``.

    hidden: ``[B, S, H]``; loss_positions: ``[N]`` flat indices into ``B * S`` of the positions
    that predict; loss_targets: ``[N]`` the tokens they must predict (ignored slots never count
    as correct); correct_out: ``[]`` fp32, gets the count of argmax hits added (see the module
    docstring).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, loss_positions)  # [N, H]
    result = _ChunkedCrossEntropy.apply(
        flat, loss_targets, tree.compute_logits, chunk_tokens, correct_out
    )
    assert isinstance(result, torch.Tensor)
    return result
