"""CUDA-graph support of the trainer that runs without a GPU: shape buckets and keys, input
packing, bucket-aware planning, and the eager fallback when a capture is impossible."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.batching import DataStream, collate
from gpu_runtime.finetune.data import IGNORE_INDEX, TokenizedExample
from gpu_runtime.finetune.graph_policy import CapturePolicy, GraphKey, bucket_length
from gpu_runtime.finetune.graphs import graph_key, pack_inputs, unpack_inputs
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.finetune.loss import chunked_lm_head_loss, training_hidden_states
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM


def test_bucket_lengths() -> None:
    assert [bucket_length(n) for n in (1, 64, 65, 80, 81, 128, 129, 256, 257, 300)] == [
        64,
        64,
        80,
        80,
        96,
        128,
        160,
        256,
        320,
        320,
    ]
    assert bucket_length(2048) == 2048 and bucket_length(2049) == 2560
    previous = 0
    for n in range(1, 5000):
        b = bucket_length(n)
        assert b >= n and b >= previous and b % 16 == 0
        if n > 64:
            assert (b - n) / n < 0.25, n  # under 25 % padding
        previous = b
    assert len({bucket_length(n) for n in range(1, 2049)}) == 21  # 64, then 4 per octave
    with pytest.raises(ValueError):
        bucket_length(0)


def test_capture_policy_captures_frequent_shapes_without_thrashing() -> None:
    policy = CapturePolicy(max_graphs=2, capture_after=2, stale_after=3)
    a, b, c, d = (GraphKey(1, n, n, stream=7) for n in (64, 80, 96, 112))

    def decide(key: GraphKey, warm: bool = True) -> tuple[str, str | None, GraphKey | None]:
        decision = policy.decide(key, warm)
        if decision.action == "capture":
            if decision.evict is not None:
                policy.removed(decision.evict)
            policy.added(key)
        return decision.action, decision.reason, decision.evict

    assert decide(a, warm=False) == ("eager", "first micro-batch on this stream (warm-up)", None)
    assert decide(a) == ("capture", None, None)
    assert decide(a) == ("replay", None, None)
    assert decide(b) == ("eager", "shape seen 1x, captured from 2x", None)
    assert decide(b) == ("capture", None, None)
    assert decide(c)[0] == "eager"
    assert decide(c) == ("capture", None, a)  # a unused for 4 micro-batches: stale, dropped
    assert decide(b) == ("replay", None, None)
    assert decide(a) == ("eager", "all 2 graph slots in recent use", None)  # no thrashing
    assert decide(d)[0] == "eager"
    assert policy.captured == [c, b] and policy.seen[a] == 4
    policy.clear()
    assert policy.captured == [] and decide(c) == ("capture", None, None)
    policy.out_of_memory(d)  # a capture of d ran out of memory: d stays eager
    assert decide(d) == ("eager", "this shape's capture ran out of memory", None)
    with pytest.raises(ValueError):
        CapturePolicy(max_graphs=0)
    default = CapturePolicy()  # only the warm-up runs eagerly: no eager cache beside the pool
    assert default.decide(a, stream_warm=False).action == "eager"
    assert default.decide(b, stream_warm=True).action == "capture"


def _examples(lengths: list[int], loss_from: int = 1) -> list[TokenizedExample]:
    out = []
    for n in lengths:
        ids = tuple(1 + (7 * i + n) % 400 for i in range(n))
        labels = tuple(IGNORE_INDEX if i < loss_from else t for i, t in enumerate(ids))
        out.append(TokenizedExample(ids, labels))
    return out


def test_keys_packing_and_padded_loss_slots(serving_model: CausalLM) -> None:
    examples = _examples([20, 45, 33], loss_from=10)
    batch = collate(examples, pad_token_id=0, seq_len=bucket_length(45))
    assert batch.input_ids.shape == (3, 64) and batch.num_loss_tokens == 10 + 35 + 23
    key = graph_key(batch, stream=7)
    assert key == GraphKey(rows=3, seq_len=64, loss_slots=80, stream=7)
    packed = pack_inputs(batch, key.loss_slots)
    ids, positions, loss_positions, loss_targets = unpack_inputs(packed, key)
    assert torch.equal(ids, batch.input_ids) and torch.equal(positions, batch.positions)
    n = batch.num_loss_tokens
    assert torch.equal(loss_positions[:n], batch.loss_positions)
    assert torch.equal(loss_targets[:n], batch.loss_targets)
    assert (loss_positions[n:] == 0).all() and (loss_targets[n:] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="do not fit"):
        pack_inputs(batch, n - 1)
    with pytest.raises(ValueError, match="shorter"):
        collate(examples, seq_len=40)
    # the padded loss slots add nothing to the loss or the gradients
    tree = build_training_model(serving_model, LoraSpec(dropout=0.0), seed=0)
    with torch.no_grad():
        for p in adapter_parameters(tree):
            p.normal_(0, 0.05)
    results = []
    for positions_, targets_ in (
        (batch.loss_positions, batch.loss_targets),
        (loss_positions, loss_targets),
    ):
        hidden = training_hidden_states(tree, batch.input_ids, batch.positions)
        loss = chunked_lm_head_loss(tree, hidden, positions_, targets_, chunk_tokens=32)
        loss.backward()
        grads = [p.grad.clone() for p in adapter_parameters(tree) if p.grad is not None]
        results.append((loss.detach(), grads))
        tree.zero_grad(set_to_none=True)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-5)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_plan_bounds_tokens_by_bucketed_length() -> None:
    examples = _examples([70, 70, 70, 70])
    stream = DataStream(examples, batch_size=4, n_epochs=1, seed=0)
    # 70 tokens pad to 72 (multiple of 8) but to an 80-token bucket
    assert len(stream.plan(max_tokens=216, pad_to_multiple=8).example_indices) == 3
    bucketed = stream.plan(max_tokens=216, padded_length=bucket_length)
    assert len(bucketed.example_indices) == 2
    assert len(stream.plan(max_tokens=1, padded_length=bucket_length).example_indices) == 1


def _hparams(n: int, dropout: float) -> Any:
    return resolve_hyperparameters(
        n_train_examples=n,
        n_epochs=2,
        batch_size=4,
        lora=LoraSpec(rank=8, alpha=16, dropout=dropout),
        seed=0,
        warmup_ratio=0.0,
    )


def test_graphs_off_by_default_on_cpu(serving_model: CausalLM, train_examples: Any) -> None:
    trainer = LoraTrainer(serving_model, train_examples, _hparams(len(train_examples), 0.0))
    assert trainer.graphs is None
    result = trainer.step_quantum(max_examples=2)
    assert result.graph == "off" and result.graph_fallback is None
    assert result.launch_s is not None and result.host_s is not None
    assert 0 < result.launch_s <= result.host_s <= result.wall_s


def test_failed_capture_falls_back_to_eager_with_reason(
    serving_model: CausalLM, train_examples: Any
) -> None:
    """On the CPU a capture cannot happen: the trainer records why and trains eagerly, on
    bucket-padded micro-batches, to the same results as without graphs (no dropout: masks
    depend on the padded shape)."""
    hparams = _hparams(len(train_examples), 0.0)
    plain = LoraTrainer(serving_model, train_examples, hparams, cuda_graphs=False)
    graphed = LoraTrainer(serving_model, train_examples, hparams, cuda_graphs=True)
    assert plain.graphs is None and graphed.graphs is not None
    graphs = graphed.graphs
    results = []
    while not graphed.finished:
        results.append(graphed.step_quantum(max_examples=2))
        plain.step_quantum(max_examples=2)
    assert plain.finished
    first, second = results[0], results[1]
    assert first.graph == "eager" and "warm-up" in (first.graph_fallback or "")
    assert second.graph == "eager" and "CUDA graphs need a CUDA device" in (
        second.graph_fallback or ""
    )
    assert graphs.disabled == second.graph_fallback
    assert all(r.graph_fallback == graphs.disabled for r in results[1:])
    assert graphs.counts["eager"] == len(results) and not graphs.keys()
    assert all(r.padded_tokens % 64 == 0 for r in results)  # bucket-padded (>= 64 tokens)
    assert [h.step for h in graphed.history] == [h.step for h in plain.history]
    for a, b in zip(graphed.history, plain.history, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    for p, q in zip(graphed.params, plain.params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    # grads are zeroed in place, never replaced, while graphs are in use
    assert all(p.grad is not None and not p.grad.any() for p in graphed.params)
    assert all(p.grad is None for p in plain.params)


def test_disable_cuda_graphs_runs_eagerly_with_the_reason(
    serving_model: CausalLM, train_examples: Any
) -> None:
    """The supported switch: every later micro-batch runs eagerly and reports the caller's
    reason, before any capture was tried; a second call keeps the first reason; a trainer
    without graphs takes the call as a no-op."""
    hparams = _hparams(len(train_examples), 0.0)
    graphed = LoraTrainer(serving_model, train_examples, hparams, cuda_graphs=True)
    assert graphed.graphs is not None
    graphed.disable_cuda_graphs("worker stream failed")
    graphed.disable_cuda_graphs("another reason")
    result = graphed.step_quantum(max_examples=2)
    assert result.graph == "eager" and result.graph_fallback == "worker stream failed"
    assert graphed.graphs.disabled == "worker stream failed" and not graphed.graphs.keys()
    plain = LoraTrainer(serving_model, train_examples, hparams, cuda_graphs=False)
    plain.disable_cuda_graphs("no graphs here")
    assert plain.graphs is None and plain.step_quantum(max_examples=2).graph == "off"


def test_layer_sliced_quanta_say_they_ran_eagerly(
    serving_model: CausalLM, train_examples: Any
) -> None:
    trainer = LoraTrainer(
        serving_model, train_examples, _hparams(len(train_examples), 0.0), cuda_graphs=True
    )
    result = trainer.step_quantum(max_examples=2, max_layers=1)
    assert result.graph == "eager" and result.graph_fallback == "layer-sliced quanta run eagerly"


def test_trainer_with_graphs_is_freed_without_the_cycle_collector(
    serving_model: CausalLM, train_examples: Any
) -> None:
    """The graphs hold their trainer's methods weakly: a finished job's graph pool is released
    when its trainer is dropped, not whenever the cycle collector runs."""
    import gc
    import weakref

    trainer = LoraTrainer(
        serving_model, train_examples, _hparams(len(train_examples), 0.0), cuda_graphs=True
    )
    trainer.step_quantum(max_examples=2)
    ref = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert ref() is None
    finally:
        gc.enable()


def test_replays_next_looks_without_moving_the_data(
    serving_model: CausalLM, train_examples: Any
) -> None:
    """Nothing captured yet: the next micro-batch would not replay (a cold launch); asking
    changes nothing; a trainer without graphs, or whose graphs were turned off, says None."""
    hparams = _hparams(len(train_examples), 0.0)
    graphed = LoraTrainer(serving_model, train_examples, hparams, cuda_graphs=True)
    longest = max(e.num_tokens for e in train_examples)
    before = graphed.stream.position
    assert graphed.replays_next(2 * longest, [0]) == {0: False}
    assert graphed.stream.position == before and graphed.graphs is not None
    assert not graphed.graphs.counts and not graphed.graphs.keys()
    graphed.step_quantum(max_examples=2)  # warm-up, then the CPU capture fails: graphs off
    graphed.step_quantum(max_examples=2)
    assert graphed.graphs.disabled is not None
    assert graphed.replays_next(2 * longest, [0]) is None
    plain = LoraTrainer(serving_model, train_examples, hparams, cuda_graphs=False)
    assert plain.replays_next(2 * longest, [0]) is None
