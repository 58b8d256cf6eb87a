"""One micro-batch's forward and backward cut into slices of decoder layers.

A quantum of ``k`` layers runs ``k`` decoder layers of the forward pass, or of the backward pass,
of the micro-batch in progress; the LM-head loss rides with the last forward slice. Backward
runs whole forward slices (the autograd graph is cut there), at least one per call. Slices are
joined by detached tensors: the forward of slice ``[a, b)`` starts from ``x_a`` detached (with
``requires_grad``) and keeps its output ``x_b`` with its autograd graph; the backward of that
slice is ``x_b.backward(grad of x_b)``, which leaves the gradient for the slice below in
``x_a.grad``. Nothing is recomputed, activations are kept between quanta exactly as in a plain
forward/backward, and the gradients equal the unsliced ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class LayerStack(Protocol):
    """A training forward pass that can run layer ranges (both training forwards implement it)."""

    @property
    def num_layers(self) -> int: ...

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def run_layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layers: range,
        activation_checkpointing: bool,
    ) -> torch.Tensor: ...

    def final_norm(self, x: torch.Tensor) -> torch.Tensor: ...


class SlicedMicroBatch:
    """Advance one micro-batch by up to ``max_layers`` layer passes per :meth:`advance`."""

    def __init__(
        self,
        stack: LayerStack,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        loss_sum_fn: Callable[[torch.Tensor], torch.Tensor],
        denominator: int,
        activation_checkpointing: bool,
    ) -> None:
        """``loss_sum_fn(hidden) -> summed loss``; gradients are of ``loss_sum / denominator``."""
        self.stack = stack
        self.input_ids, self.positions = input_ids, positions
        self.loss_sum_fn = loss_sum_fn
        self.denominator = denominator
        self.checkpointing = activation_checkpointing
        self.next_layer = 0  # forward progress
        # (detached input, output with graph, number of layers) per forward slice
        self.slices: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.loss_sum: torch.Tensor | None = None
        self._grad: torch.Tensor | None = None  # gradient of the top remaining slice's output
        self._x: torch.Tensor | None = None
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.loss_sum is not None and not self.slices

    @property
    def total_layer_passes(self) -> int:
        return 2 * self.stack.num_layers

    def advance(self, max_layers: int) -> int:
        """Run up to ``max_layers`` layer passes (at least one); returns how many ran."""
        if max_layers < 1:
            raise ValueError(f"max_layers must be >= 1, got {max_layers}")
        if self.done:
            raise RuntimeError("micro-batch already done")
        if self.loss_sum is None:
            return self._forward(max_layers)
        return self._backward(max_layers)

    def _forward(self, max_layers: int) -> int:
        if self._x is None:
            with torch.no_grad():
                self._x, self._cos, self._sin = self.stack.embed(self.input_ids, self.positions)
        assert self._cos is not None and self._sin is not None
        end = min(self.stack.num_layers, self.next_layer + max_layers)
        x_in = self._x.detach().requires_grad_(self.next_layer > 0)
        with torch.enable_grad():
            out = self.stack.run_layers(
                x_in, self._cos, self._sin, range(self.next_layer, end), self.checkpointing
            )
        ran = end - self.next_layer
        self.slices.append((x_in, out, ran))
        self.next_layer = end
        self._x = out
        if end == self.stack.num_layers:
            top = out.detach().requires_grad_(True)
            with torch.enable_grad():
                loss_sum = self.loss_sum_fn(self.stack.final_norm(top))
                (loss_sum / self.denominator).backward()
            self.loss_sum = loss_sum.detach()
            self._grad = top.grad
            self._x = None
        return ran

    def _backward(self, max_layers: int) -> int:
        """Whole forward slices, top down, while they fit (always at least one)."""
        ran = 0
        while self.slices:
            x_in, out, width = self.slices[-1]
            if ran and ran + width > max_layers:
                break
            self.slices.pop()
            out.backward(self._grad)
            self._grad = x_in.grad
            ran += width
        return ran
