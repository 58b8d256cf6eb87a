"""CUDA-graphed training quanta against eager ones, on CUDA in bf16 (skipped without a GPU)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.checkpoint import load_checkpoint
from gpu_runtime.finetune.data import IGNORE_INDEX, TokenizedExample
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM
from tests.gpu_runtime.finetune.conftest import cuda_serving_model

pytestmark = pytest.mark.gpu


def _serving(layers: int = 4) -> CausalLM:
    model: CausalLM = cuda_serving_model(layers)
    return model


def _examples(lengths: list[int], seed: int = 0) -> list[TokenizedExample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, 480, (n,), generator=gen).tolist()
        out.append(TokenizedExample(tuple(ids), (IGNORE_INDEX, *ids[1:])))
    return out


def _hparams(n: int, dropout: float, **options: Any) -> Any:
    return resolve_hyperparameters(
        n_train_examples=n,
        n_epochs=2,
        batch_size=4,
        learning_rate_multiplier=20.0,
        lora=LoraSpec(rank=8, dropout=dropout, target_modules=("all-linear",)),
        warmup_ratio=0.0,
        **options,
    )


def test_graphed_quanta_equal_eager_ones_with_dropout() -> None:
    """Same shapes (64 tokens is both a bucket and a multiple of 8): the graph draws the same
    dropout masks from the trainer's generator, so losses and adapters match eager training."""
    serving = _serving()
    examples = _examples([64] * 12)
    hparams = _hparams(len(examples), dropout=0.1)
    eager = LoraTrainer(serving, examples, hparams, cuda_graphs=False)
    graphed = LoraTrainer(serving, examples, hparams)
    assert eager.graphs is None and graphed.graphs is not None  # on by default on CUDA
    graphs = graphed.graphs
    modes = []
    while not graphed.finished:
        modes.append(graphed.step_quantum(max_examples=2).graph)
        eager.step_quantum(max_examples=2)
    assert graphs.disabled is None, graphs.disabled
    assert modes[:3] == ["eager", "capture", "replay"] and set(modes[3:]) == {"replay"}
    assert len(graphed.history) == len(eager.history) == 6
    for a, b in zip(graphed.history, eager.history, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=2e-3)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=2e-2)
    for p, q in zip(graphed.params, eager.params, strict=True):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-4)
    # the trainer's CUDA generator advanced by exactly as much in both
    assert graphed.rng.cuda_state is not None and eager.rng.cuda_state is not None
    assert torch.equal(graphed.rng.cuda_state, eager.rng.cuda_state)


def test_replay_has_near_zero_host_cost() -> None:
    serving = _serving(layers=8)
    examples = _examples([128] * 16)
    hparams = _hparams(len(examples), dropout=0.05)
    launches: dict[bool, list[float]] = {}
    hosts: dict[bool, list[float]] = {}
    for graphs in (False, True):
        trainer = LoraTrainer(serving, examples, hparams, cuda_graphs=graphs)
        results = [trainer.step_quantum(max_examples=2) for _ in range(10)]
        timed = [r for r in results[2:] if r.graph in ("off", "replay")]
        launches[graphs] = [r.launch_s for r in timed if r.launch_s is not None]
        hosts[graphs] = [r.host_s for r in timed if r.host_s is not None]
    eager_ms = statistics.median(launches[False]) * 1e3
    replay_ms = statistics.median(launches[True]) * 1e3
    assert replay_ms < 0.15 * eager_ms and replay_ms < 2.0, (replay_ms, eager_ms)
    # the whole quantum's CPU work (collation, optimizer step included) shrinks too
    assert statistics.median(hosts[True]) < 0.5 * statistics.median(hosts[False]), hosts


def test_one_graph_per_stream() -> None:
    """A graph replays in the context it was captured in: each stream gets its own."""
    serving = _serving()
    examples = _examples([64] * 14, seed=3)
    trainer = LoraTrainer(serving, examples, _hparams(len(examples), dropout=0.1))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    modes = []
    for index in (0, 0, 0, 1, 1, 1, 0):  # as the co-location executor makes partitions current
        with torch.cuda.stream(streams[index]):
            modes.append(trainer.step_quantum(max_examples=2).graph)
    torch.cuda.synchronize()
    assert modes == ["eager", "capture", "replay"] * 2 + ["replay"]
    graphs = trainer.graphs
    assert graphs is not None and graphs.disabled is None
    assert sorted(k.stream for k in graphs.keys()) == sorted(s.cuda_stream for s in streams)


def test_bucketed_shapes_train_like_eager() -> None:
    serving = _serving()
    examples = _examples([30, 50, 70, 90, 100, 60, 20, 40] * 6, seed=1)
    hparams = _hparams(len(examples), dropout=0.0)
    eager = LoraTrainer(serving, examples, hparams, cuda_graphs=False)
    graphed = LoraTrainer(serving, examples, hparams, max_cuda_graphs=4)
    while not graphed.finished:  # buckets cut batches into other micro-batches than eager
        result = graphed.step_quantum(max_tokens=200)
        assert result.padded_tokens <= 200 and result.padded_tokens % 16 == 0
    while not eager.finished:
        eager.step_quantum(max_tokens=200)
    graphs = graphed.graphs
    assert graphs is not None
    assert graphs.disabled is None, graphs.disabled
    assert 1 <= len(graphs.keys()) <= 4 and graphs.counts["replay"] >= 1
    for a, b in zip(graphed.history, eager.history, strict=True):  # other padding: bf16 noise
        assert a.loss == pytest.approx(b.loss, rel=2e-2)


def test_released_graphs_give_their_pool_back() -> None:
    serving = _serving()
    examples = _examples([512] * 16, seed=4)
    trainer = LoraTrainer(serving, examples, _hparams(len(examples), dropout=0.0))
    modes = [trainer.step_quantum(max_examples=4).graph for _ in range(3)]
    assert modes == ["eager", "capture", "replay"]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    trainer.release_cuda_graphs()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < held  # the graph pool went back to the device
    modes = [trainer.step_quantum(max_examples=4).graph for _ in range(3)]
    assert modes == ["capture", "replay", "replay"]  # the shape was seen: captured at once


def test_graphed_training_resumes_exactly(tmp_path: Path) -> None:
    serving = _serving()
    examples = _examples([64] * 12, seed=2)
    hparams = _hparams(len(examples), dropout=0.1, checkpoint_every_steps=1)
    full = LoraTrainer(serving, examples, hparams, checkpoint_root=tmp_path / "a")
    while not full.finished:
        full.step_quantum(max_examples=2)
    part = LoraTrainer(serving, examples, hparams, checkpoint_root=tmp_path / "b")
    path = None
    while part.step < 3:
        path = part.step_quantum(max_examples=2).checkpoint or path
    assert path is not None and path.name == "step-000003"
    resumed = LoraTrainer(serving, examples, hparams)
    load_checkpoint(resumed, path)
    while not resumed.finished:
        resumed.step_quantum(max_examples=2)
    tail = [h.loss for h in full.history[3:]]
    assert [h.loss for h in resumed.history[3:]] == pytest.approx(tail, rel=1e-3)
    for p, q in zip(full.params, resumed.params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-4)


def test_start_quantum_launches_without_waiting_and_trains_like_step_quantum() -> None:
    serving = _serving()
    examples = _examples([64] * 8)
    hparams = _hparams(len(examples), dropout=0.1)
    launched = LoraTrainer(serving, examples, hparams)
    stepped = LoraTrainer(serving, examples, hparams)
    side = torch.cuda.Stream()
    results = []
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up (eager), capture, replay
            pending = launched.start_quantum(max_examples=2)
            if not pending.done():  # a replay: launched, not waited for
                with pytest.raises(RuntimeError, match="not been read"):
                    launched.start_quantum(max_examples=2)
            results.append(pending.result())
            assert pending.result() is results[-1]
    torch.cuda.synchronize()
    assert [r.graph for r in results] == ["eager", "capture", "replay"]
    assert results[-1].gpu_ms is not None and results[-1].gpu_ms > 0
    for _ in range(3):
        stepped.step_quantum(max_examples=2)
    assert len(launched.history) == len(stepped.history) == 1
    assert launched.history[0].loss == pytest.approx(stepped.history[0].loss, rel=2e-3)
    for p, q in zip(launched.params, stepped.params, strict=True):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-4)


def test_replays_next_says_which_launches_have_a_graph_on_which_stream() -> None:
    serving = _serving()
    examples = _examples([64] * 16)
    trainer = LoraTrainer(serving, examples, _hparams(len(examples), dropout=0.0))
    mine, other = torch.cuda.Stream(), torch.cuda.Stream()  # as the loop's finetune streams
    both = (mine.cuda_stream, other.cuda_stream)
    assert trainer.replays_next(2 * 64, both) == dict.fromkeys(both, False)  # nothing yet
    with torch.cuda.stream(mine):
        modes = [trainer.step_quantum(max_tokens=2 * 64).graph for _ in range(2)]
    assert modes == ["eager", "capture"]  # the batch of 4 is done: the next starts afresh
    # Captured on one stream only; 1 row is another shape.
    assert trainer.replays_next(2 * 64, both) == {mine.cuda_stream: True, other.cuda_stream: False}
    assert trainer.replays_next(64, both) == dict.fromkeys(both, False)
    with torch.cuda.stream(mine):
        assert trainer.step_quantum(max_tokens=2 * 64).graph == "replay"


def test_separately_pooled_shape_is_released_alone_and_trains_like_one_pool() -> None:
    """With `separate_above(1)` the 4-example shape has its own pool: releasing it returns that
    pool to the device while the 1-example graph keeps replaying, and it is captured again
    when it comes back; losses equal a trainer whose shapes share one pool."""
    from gpu_runtime.finetune.graph_pools import SHARED, PoolGroups, separate_above

    serving = _serving()
    examples = _examples([512] * 40, seed=5)
    hparams = _hparams(len(examples), dropout=0.0)
    shared = LoraTrainer(serving, examples, hparams)
    separate = LoraTrainer(serving, examples, hparams)
    assert separate.graphs is not None and shared.graphs is not None
    separate.graphs.pool_groups = PoolGroups(separate_above(1))
    # micro-batches stay within an optimizer batch (4 examples): 4 x 1, then 4 at once
    schedule = [1, 1, 1, 1, 4, 4, 1, 1, 1, 1, 4]
    for trainer in (shared, separate):
        modes = [trainer.step_quantum(max_examples=n).graph for n in schedule]
        assert modes == ["eager", "capture", "replay", "replay", "capture"] + ["replay"] * 6
    groups = separate.graphs.pool_groups.groups()
    assert set(groups) == {SHARED, ("rows", 4)}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    assert shared.graphs.release_largest_separate() == []  # one pool: nothing alone
    dropped = separate.graphs.release_largest_separate()
    assert [k.rows for k in dropped] == [4] and separate.graphs.counts["released"] == 1
    torch.cuda.empty_cache()
    freed = held - torch.cuda.memory_reserved()
    assert freed > 0  # the 4-example pool went back; the shared one stays
    assert {k.rows for k in separate.graphs.keys()} == {1}
    tail = [1, 1, 1, 1, 4, 4]
    modes = [separate.step_quantum(max_examples=n).graph for n in tail]
    assert modes == ["replay"] * 4 + ["capture", "replay"]
    assert [shared.step_quantum(max_examples=n).graph for n in tail] == ["replay"] * 6
    torch.cuda.synchronize()
    assert len(separate.history) == len(shared.history) >= 4
    for a, b in zip(separate.history, shared.history, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-3)


def test_graphed_recomputing_quanta_equal_eager_ones() -> None:
    """Quanta alternating with and without activation recomputation: each mode is captured as
    its own graph (the checkpointed layers touch no RNG state, so the capture succeeds) and
    replays the eager trainer's losses, adapters and dropout draws."""
    serving = _serving()
    examples = _examples([64] * 16, seed=5)
    hparams = _hparams(len(examples), dropout=0.1)
    eager = LoraTrainer(serving, examples, hparams, cuda_graphs=False)
    graphed = LoraTrainer(serving, examples, hparams)
    graphs = graphed.graphs
    assert graphs is not None
    runs = []
    for index in range(8):
        mode = index % 2 == 1
        result = graphed.step_quantum(max_examples=2, recompute=mode)
        expected = eager.step_quantum(max_examples=2, recompute=mode)
        assert result.recompute == expected.recompute == mode
        assert result.loss == pytest.approx(expected.loss, rel=2e-3)
        runs.append((result.graph, mode))
    assert graphs.disabled is None, graphs.disabled
    assert runs[:3] == [("eager", False), ("capture", True), ("capture", False)]
    assert {graph for graph, _ in runs[3:]} == {"replay"}
    assert sorted(key.recompute for key in graphs.keys()) == [False, True]
    assert graphed.recompute_micro_batches == eager.recompute_micro_batches == 4
    for p, q in zip(graphed.params, eager.params, strict=True):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-4)
    assert graphed.rng.cuda_state is not None and eager.rng.cuda_state is not None
    assert torch.equal(graphed.rng.cuda_state, eager.rng.cuda_state)


def test_a_recomputing_graph_needs_less_memory() -> None:
    """The memory a captured micro-batch's work needs (`extra_bytes`, what its graph pool must
    hold): with recomputation only the layers' inputs stay alive through the backward (no
    dropout here: its masks stay alive in both modes)."""
    serving = _serving(layers=8)
    examples = _examples([512] * 8, seed=6)
    trainer = LoraTrainer(serving, examples, _hparams(len(examples), dropout=0.0))
    graphs = trainer.graphs
    assert graphs is not None
    for mode in (False, True, False):  # warm-up, then one capture per mode
        trainer.step_quantum(max_examples=2, recompute=mode)
    assert graphs.disabled is None, graphs.disabled
    extra = {key.recompute: graphs._graphs[key].extra_bytes for key in graphs.keys()}
    assert extra[True] < 0.7 * extra[False], extra


def test_graphed_token_accuracy_and_validation_match_eager() -> None:
    """The loss adds argmax hits into the trainer's tensor in place: a captured graph adds on
    each replay, once, like an eager micro-batch; the validation pass runs beside the graphs."""
    serving = _serving()
    constant = [TokenizedExample((7,) * 64, (IGNORE_INDEX, *(7,) * 63)) for _ in range(12)]
    hparams = _hparams(len(constant), dropout=0.0)
    valid = constant[:3]
    eager = LoraTrainer(serving, constant, hparams, cuda_graphs=False, validation_examples=valid)
    graphed = LoraTrainer(serving, constant, hparams, validation_examples=valid)
    modes = []
    while not graphed.finished:
        modes.append(graphed.step_quantum(max_examples=2).graph)
        eager.step_quantum(max_examples=2)
    assert "replay" in modes
    pairs = zip(graphed.history, eager.history, strict=True)
    accuracies = [(a.accuracy, b.accuracy) for a, b in pairs]
    for a, b in accuracies:
        assert a is not None and b is not None and 0.0 <= a <= 1.0
        assert a == pytest.approx(b, abs=0.05)
    assert (graphed.history[-1].accuracy or 0.0) > 0.5, accuracies
    ours, theirs = graphed.checkpoints.metrics(final=True), eager.checkpoints.metrics(final=True)
    assert ours["valid_loss"] == pytest.approx(theirs["valid_loss"], rel=2e-2, abs=1e-3)
    assert ours["full_valid_mean_token_accuracy"] == pytest.approx(
        theirs["full_valid_mean_token_accuracy"], abs=0.05
    )
