"""Length-aware, seeded ordering; micro-batch planning; saved and restored data positions."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.finetune.batching import DataPosition, DataStream, collate, epoch_order
from gpu_runtime.finetune.data import IGNORE_INDEX, TokenizedExample


def _example(length: int, first_label: int = 1) -> TokenizedExample:
    ids = tuple(range(10, 10 + length))
    labels = tuple([IGNORE_INDEX] * first_label + list(ids[first_label:]))
    return TokenizedExample(ids, labels)


LENGTHS = [3, 17, 5, 9, 30, 2, 11, 8, 25, 4, 6, 13, 7, 19, 10, 12, 14, 3, 21, 16]


def test_epoch_order_is_a_seeded_permutation_with_length_sorted_batches() -> None:
    order = epoch_order(LENGTHS, batch_size=4, seed=7, epoch=0, window_batches=2)
    assert sorted(order) == list(range(len(LENGTHS)))
    assert order == epoch_order(LENGTHS, batch_size=4, seed=7, epoch=0, window_batches=2)
    assert order != epoch_order(LENGTHS, batch_size=4, seed=7, epoch=1, window_batches=2)
    assert order != epoch_order(LENGTHS, batch_size=4, seed=8, epoch=0, window_batches=2)
    for start in range(0, len(order), 4):
        batch_lengths = [LENGTHS[i] for i in order[start : start + 4]]
        assert batch_lengths == sorted(batch_lengths, reverse=True)


def test_length_bucketing_reduces_padding() -> None:
    def padded(order: list[int]) -> int:
        return sum(
            max(LENGTHS[i] for i in order[s : s + 4]) * len(order[s : s + 4])
            for s in range(0, len(order), 4)
        )

    bucketed = epoch_order(LENGTHS, batch_size=4, seed=0, epoch=0, window_batches=5)
    unbucketed = epoch_order(LENGTHS, batch_size=4, seed=0, epoch=0, window_batches=1)
    assert padded(bucketed) < padded(unbucketed)


def test_plan_respects_batch_end_examples_and_tokens() -> None:
    examples = [_example(n) for n in LENGTHS]
    stream = DataStream(examples, batch_size=8, n_epochs=2, seed=3)
    order = stream.order(0)
    plan = stream.plan(max_examples=3)
    assert plan.example_indices == tuple(order[:3])
    assert not plan.completes_batch
    assert plan.batch_loss_tokens == sum(examples[i].num_loss_tokens for i in order[:8])
    stream.commit(plan)
    longest = LENGTHS[order[3]]  # batches are sorted longest first
    plan = stream.plan(max_tokens=2 * longest)
    assert len(plan.example_indices) == 2
    stream.commit(plan)
    plan = stream.plan()  # the rest of the batch, never past its end
    assert plan.example_indices == tuple(order[5:8])
    assert plan.completes_batch
    stream.commit(plan)
    assert stream.position == DataPosition(0, 8)
    plan = stream.plan(max_tokens=1)  # one example even when it alone is over the bound
    assert len(plan.example_indices) == 1
    stream.commit(stream.plan(max_examples=1))
    with pytest.raises(RuntimeError, match="plan made at"):
        stream.commit(plan)  # stale: made before the last commit


def test_stream_walks_every_epoch_and_resumes_exactly() -> None:
    examples = [_example(n) for n in LENGTHS]
    full = DataStream(examples, batch_size=6, n_epochs=2, seed=11)
    seen: list[tuple[int, ...]] = []
    positions: list[DataPosition] = []
    while not full.finished:
        positions.append(full.position)
        plan = full.plan(max_examples=4)
        seen.append(plan.example_indices)
        full.commit(plan)
    assert full.total_optimizer_steps == 8
    for epoch in (0, 1):
        consumed = [
            i for p, ix in zip(positions, seen, strict=True) if p.epoch == epoch for i in ix
        ]
        assert sorted(consumed) == list(range(len(LENGTHS)))
    k = 5
    resumed = DataStream(examples, batch_size=6, n_epochs=2, seed=11)
    resumed.restore(DataPosition.from_dict(positions[k].to_dict()))
    rest: list[tuple[int, ...]] = []
    while not resumed.finished:
        plan = resumed.plan(max_examples=4)
        rest.append(plan.example_indices)
        resumed.commit(plan)
    assert rest == seen[k:]
    with pytest.raises(ValueError, match="outside"):
        resumed.restore(DataPosition(2, 3))


def test_collate_right_pads_with_ignored_labels() -> None:
    batch = collate([_example(5), _example(3)], pad_token_id=0, pad_to_multiple=4)
    assert batch.input_ids.shape == (2, 8)
    assert batch.num_tokens == 8
    assert batch.num_loss_tokens == 4 + 2
    assert batch.input_ids[1, 3:].eq(0).all()
    assert batch.labels[1, 3:].eq(IGNORE_INDEX).all()
    assert torch.equal(batch.positions[1], torch.arange(8))


def test_token_bound_counts_padding_rounding() -> None:
    examples = [_example(9) for _ in range(4)]
    stream = DataStream(examples, batch_size=4, n_epochs=1, seed=0)
    assert len(stream.plan(max_tokens=36).example_indices) == 4  # 4 x 9
    assert len(stream.plan(max_tokens=36, pad_to_multiple=8).example_indices) == 2  # 2 x 16
    assert collate([examples[0]] * 2, pad_to_multiple=8).padded_tokens == 32
