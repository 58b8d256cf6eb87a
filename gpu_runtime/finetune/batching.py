"""Deterministic, length-aware ordering of examples into optimizer batches and micro-batches.

Each epoch's order is a pure function of ``(seed, epoch, example lengths, batch_size)``:

1. a seeded shuffle of all example indices;
2. windows of ``batch_size * window_batches`` examples, each sorted by length (longest first), so
   one optimizer batch holds examples of similar length and micro-batches carry little padding;
3. consecutive runs of ``batch_size`` form the optimizer batches (the last may be short), whose
   order is shuffled again with the same seed.

So the data position is just ``(epoch, index)`` — how many examples of that epoch's order were
consumed — and restoring it restores the stream exactly. Optimizer batches start at multiples of
``batch_size`` in the order, whatever micro-batch sizes the scheduler picks, which is what makes
training results independent of how work was cut into quanta.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gpu_runtime.finetune.data import IGNORE_INDEX, TokenizedExample


@dataclass(frozen=True)
class DataPosition:
    """Where the stream stands: ``index`` examples of epoch ``epoch`` (0-based) consumed."""

    epoch: int
    index: int

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, raw: dict[str, int]) -> DataPosition:
        return cls(epoch=int(raw["epoch"]), index=int(raw["index"]))


def epoch_order(
    lengths: Sequence[int], batch_size: int, seed: int, epoch: int, window_batches: int = 8
) -> list[int]:
    """The example indices of one epoch, in training order (see the module docstring)."""
    if batch_size < 1 or window_batches < 1:
        raise ValueError(
            f"batch_size={batch_size} and window_batches={window_batches} must be >= 1"
        )
    rng = random.Random(f"harli-finetune:{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * window_batches
    by_length: list[int] = []
    for start in range(0, len(order), window):
        chunk = order[start : start + window]
        by_length.extend(sorted(chunk, key=lambda i: -lengths[i]))
    batches = [by_length[i : i + batch_size] for i in range(0, len(by_length), batch_size)]
    rng.shuffle(batches)
    return [i for batch in batches for i in batch]


@dataclass(frozen=True)
class MicroBatchPlan:
    """The examples a quantum will train on, before any tensor is built.

    ``batch_loss_tokens`` is the number of loss targets in the whole optimizer batch this
    micro-batch belongs to: each micro-batch's summed loss is divided by it, so accumulated
    gradients equal the gradient of the batch's mean token loss however the batch was split.
    """

    example_indices: tuple[int, ...]
    position: DataPosition
    position_after: DataPosition
    completes_batch: bool
    batch_loss_tokens: int


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors of one micro-batch. Right padding keeps causal attention exact."""

    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64, IGNORE_INDEX on prompt and padding
    positions: torch.Tensor  # [B, S] int64
    loss_positions: torch.Tensor  # [N] int64: flat indices into B*S of positions that predict
    loss_targets: torch.Tensor  # [N] int64: the token each of them must predict
    num_tokens: int  # real (unpadded) tokens
    num_loss_tokens: int

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same micro-batch with every tensor on ``device`` (copies are asynchronous)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return MicroBatch(
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            positions=move(self.positions),
            loss_positions=move(self.loss_positions),
            loss_targets=move(self.loss_targets),
            num_tokens=self.num_tokens,
            num_loss_tokens=self.num_loss_tokens,
        )


def collate(
    examples: Sequence[TokenizedExample],
    pad_token_id: int = 0,
    pad_to_multiple: int = 1,
    seq_len: int | None = None,
) -> MicroBatch:
    """Right-pad examples to the longest (rounded up to ``pad_to_multiple``), or to ``seq_len``
    when given (a fixed shape, e.g. a CUDA graph's bucket; at least the longest example)."""
    if not examples:
        raise ValueError("cannot collate an empty micro-batch")
    longest = max(e.num_tokens for e in examples)
    if seq_len is None:
        seq_len = -(-longest // pad_to_multiple) * pad_to_multiple
    elif seq_len < longest:
        raise ValueError(f"seq_len {seq_len} is shorter than the longest example ({longest})")
    input_ids = torch.full((len(examples), seq_len), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), seq_len), IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        input_ids[row, : example.num_tokens] = torch.tensor(example.input_ids, dtype=torch.long)
        labels[row, : example.num_tokens] = torch.tensor(example.labels, dtype=torch.long)
    positions = torch.arange(seq_len, dtype=torch.long).expand(len(examples), seq_len).clone()
    # Position t predicts labels[t + 1] (causal shift), computed here so the device never syncs.
    rows, cols = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    return MicroBatch(
        input_ids=input_ids,
        labels=labels,
        positions=positions,
        loss_positions=rows * seq_len + cols,
        loss_targets=labels[rows, cols + 1],
        num_tokens=sum(e.num_tokens for e in examples),
        num_loss_tokens=sum(e.num_loss_tokens for e in examples),
    )


class DataStream:
    """Walks ``n_epochs`` epochs of a dataset in optimizer batches, a micro-batch at a time.

    :meth:`plan` only looks; :meth:`commit` moves the position. The trainer commits after the
    micro-batch's backward succeeded, so a failed quantum (say, out of memory) leaves the stream
    where it was.
    """

    def __init__(
        self,
        examples: Sequence[TokenizedExample],
        batch_size: int,
        n_epochs: int,
        seed: int,
        position: DataPosition | None = None,
    ) -> None:
        if not examples:
            raise ValueError("DataStream needs at least one example")
        if batch_size < 1 or n_epochs < 1:
            raise ValueError(f"batch_size={batch_size} and n_epochs={n_epochs} must be >= 1")
        self.examples = tuple(examples)
        self.batch_size = batch_size
        self.n_epochs = n_epochs
        self.seed = seed
        self._lengths = [e.num_tokens for e in self.examples]
        self._order_epoch = -1
        self._order: list[int] = []
        self.position = DataPosition(0, 0)
        if position is not None:
            self.restore(position)

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.examples) // self.batch_size)

    @property
    def total_optimizer_steps(self) -> int:
        return self.batches_per_epoch * self.n_epochs

    @property
    def finished(self) -> bool:
        return self.position.epoch >= self.n_epochs

    def restore(self, position: DataPosition) -> None:
        """Jump to a saved position (checked against this dataset's size)."""
        n = len(self.examples)
        at_end = position == DataPosition(self.n_epochs, 0)
        if not at_end and not (0 <= position.epoch < self.n_epochs and 0 <= position.index < n):
            raise ValueError(f"position {position} is outside {self.n_epochs} epochs of {n}")
        self.position = position

    def order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            self._order = epoch_order(self._lengths, self.batch_size, self.seed, epoch)
            self._order_epoch = epoch
        return self._order

    def plan(
        self,
        max_examples: int | None = None,
        max_tokens: int | None = None,
        pad_to_multiple: int = 1,
        padded_length: Callable[[int], int] | None = None,
    ) -> MicroBatchPlan:
        """The next micro-batch: up to the end of the current optimizer batch, at most
        ``max_examples`` examples and ``max_tokens`` padded tokens (longest, rounded up to
        ``pad_to_multiple`` as :func:`collate` pads, or ``padded_length(longest)`` when given,
        x count); always at least one example, even when it alone exceeds ``max_tokens``."""
        if self.finished:
            raise RuntimeError("the data stream is finished")
        if max_examples is not None and max_examples < 1:
            raise ValueError(f"max_examples must be >= 1, got {max_examples}")
        epoch, index = self.position.epoch, self.position.index
        order = self.order(epoch)
        batch_start = index - index % self.batch_size
        batch_end = min(len(order), batch_start + self.batch_size)
        chosen: list[int] = []
        longest = 0
        for i in order[index:batch_end]:
            if max_examples is not None and len(chosen) >= max_examples:
                break
            length = self._lengths[i]
            if padded_length is not None:
                padded = padded_length(length)
            else:
                padded = -(-length // pad_to_multiple) * pad_to_multiple
            longest_if_added = max(longest, padded)
            if (
                chosen
                and max_tokens is not None
                and longest_if_added * (len(chosen) + 1) > max_tokens
            ):
                break
            chosen.append(i)
            longest = longest_if_added
        new_index = index + len(chosen)
        completes = new_index == batch_end
        if new_index == len(order):
            after = DataPosition(epoch + 1, 0)
        else:
            after = DataPosition(epoch, new_index)
        batch_loss_tokens = sum(
            self.examples[i].num_loss_tokens for i in order[batch_start:batch_end]
        )
        return MicroBatchPlan(
            example_indices=tuple(chosen),
            position=self.position,
            position_after=after,
            completes_batch=completes,
            batch_loss_tokens=batch_loss_tokens,
        )

    def commit(self, plan: MicroBatchPlan) -> None:
        """Advance past a planned micro-batch (must be the plan made at the current position)."""
        if plan.position != self.position:
            raise RuntimeError(f"plan made at {plan.position}, stream is at {self.position}")
        self.position = plan.position_after
