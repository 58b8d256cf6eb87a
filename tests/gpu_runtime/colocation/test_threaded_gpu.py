"""The host loop on a real GPU: graphed quanta with LoRA dropout on a split's finetune stream,
launched from the loop's thread or run on the worker thread, while the loop thread decodes with
sampling (skipped without a GPU)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from gpu_runtime.colocation import HostLoop
from gpu_runtime.colocation.baselines import StaticSplitPolicy
from gpu_runtime.colocation.executor import ThreadedExecutor
from gpu_runtime.colocation.types import QuantumReport
from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.finetune.data import IGNORE_INDEX, TokenizedExample
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.sharing import create_sharing
from tests.gpu_runtime.finetune.conftest import cuda_serving_model

pytestmark = pytest.mark.gpu


def _examples(n: int, length: int) -> list[TokenizedExample]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 480, (length,), generator=gen).tolist()
        out.append(TokenizedExample(tuple(ids), (IGNORE_INDEX, *ids[1:])))
    return out


@pytest.mark.parametrize("launch_inline", [True, False], ids=["loop-thread", "worker-thread"])
def test_graphed_dropout_quanta_beside_sampled_decode(launch_inline: bool) -> None:
    device = torch.device("cuda", 0)
    sharing = create_sharing(device, decode_groups=(6,))
    try:
        _run_beside_sampled_decode(sharing, launch_inline)
    finally:
        # Graphs captured in the green contexts, and allocator blocks of their streams, must be
        # gone before the contexts are destroyed: close() frees them (the engine froze the heap
        # after its captures, so a plain gc.collect() here would leave them to the next test's
        # engine, which aborted freeing them once the contexts were gone)
        sharing.close()


def _run_beside_sampled_decode(sharing: Any, launch_inline: bool) -> None:
    model = cuda_serving_model(4)
    engine = Engine(
        model,
        EngineConfig(
            num_kv_blocks=256,
            block_size=16,
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=512,
            device="cuda",
            cuda_graph_batch_sizes=(1, 2, 4, 8, 16),
        ),
    )
    split = sharing.table.choices[0]
    for d in sharing.table.choices:
        engine.capture_cuda_graphs(partition=d, stream=sharing.partition(d)[0], sm_count=d)
    examples = _examples(32, 64)
    hparams = resolve_hyperparameters(
        n_train_examples=len(examples),
        n_epochs=2,
        batch_size=4,
        lora=LoraSpec(rank=8, dropout=0.1, target_modules=("all-linear",)),
        warmup_ratio=0.0,
    )
    trainer = LoraTrainer(model, examples, hparams)
    # the same job trained alone on the loop thread: the reference for what it learns
    reference = LoraTrainer(model, examples, hparams)
    executor = ThreadedExecutor(time.perf_counter, launch_inline=launch_inline)
    loop = HostLoop(
        engine,
        StaticSplitPolicy(split, 1),
        tpot_slo_ms=1e9,
        sharing=sharing,
        executor=executor,
    )
    loop.add_job("ft", trainer)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, ignore_eos=True)
    finished = 0
    quanta: list[QuantumReport] = []
    for wave in range(6):
        for i in range(4):
            loop.add_request([5 + i, 7, 11 + wave] * 8, params, f"w{wave}-{i}")
        while engine.has_unfinished_requests():
            record = loop.run_iteration()
            finished += len(record.finished)
            quanta += record.quanta
    loop.close()
    errors = [q.error for q in quanta if q.error is not None]
    assert not errors, errors
    graphs = trainer.graphs
    assert graphs is not None and graphs.disabled is None, graphs and graphs.disabled
    assert graphs.counts["replay"] >= 4, graphs.counts
    assert finished == 24
    state = loop.job_state("ft")
    assert state.failed is None
    for _ in range(sum(graphs.counts.values())):  # every micro-batch the job ran
        reference.step_quantum(max_examples=1)
    assert trainer.step == reference.step
    for a, b in zip(trainer.history, reference.history, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=5e-3)
    trained, alone = trainer.rng.cuda_state, reference.rng.cuda_state
    assert trained is not None and alone is not None and torch.equal(trained, alone)
