"""The compact export graph: same function as the torch model, few nodes, bound-buffer runtime.

Models here have random weights in every layer (not the zero-initialised last layer a fresh model
has), so each folded term shows up in the outputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_runtime.predictor.artifact import artifact_dir, read_metadata
from gpu_runtime.predictor.runtime import LatencyPredictor, session_options
from gpu_runtime.predictor.schema import DecodeIteration, FinetuneQuantum
from predictor_models.compact import CompactLatencyModel
from predictor_models.dataset import ProfileData, load_profile
from predictor_models.export import export_onnx, roundtrip_rows, write_artifact
from predictor_models.model import LatencyModel
from predictor_models.pipeline import DEFAULT_DATA, DEFAULT_ROOT
from predictor_models.roofline import H200, RooflineBaseline
from predictor_models.train import TrainResult


@pytest.fixture(scope="module")
def data() -> ProfileData:
    return load_profile(DEFAULT_DATA)


def random_model(
    data: ProfileData,
    stage1: tuple[int, ...],
    stage2: tuple[int, ...],
    chunk: tuple[int, ...] = (),
    share_splits: tuple[float, ...] = (),
    **buckets: tuple[int, ...],
) -> LatencyModel:
    """Normalisers fitted on the profile's rows of each kind, every weight random."""
    torch.manual_seed(0)
    model = LatencyModel(
        data.shape, H200, stage1, stage2, chunk_hidden=chunk, share_splits=share_splits, **buckets
    )
    x = torch.tensor(data.x, dtype=torch.float32)
    with torch.no_grad():
        for net in (model.net1, model.netc, model.net2):
            for p in net.parameters():
                p.normal_(0.0, 0.3)
        s1 = x[torch.tensor(data.stage == 1)]
        f1, _ = model.stage1_features(s1)
        model.norm1.fit(f1)
        model.normc.fit(model.chunk_features(s1[s1[:, 4] > 0]))
        s2 = x[torch.tensor(data.stage == 2)]
        alone, f1 = model.alone(s2, decode_net_only=True)
        model.norm2.fit(model.stage2_features(s2, f1, alone))
    return model.eval()


def optimized_nodes(path: Path, tmp_path: Path) -> list[str]:
    import onnx
    import onnxruntime as ort

    options = session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]


DEPLOYMENT = {
    "batch_buckets": (1, 2, 4, 8, 16, 24, 32, 48, 64),
    "token_buckets": (64, 128, 256, 512),
}
DEPLOYMENT_SHARES = (48 / 132, 64 / 132, 96 / 132, 1.0)
"""The deployment's decode SM splits (the chunk network's share steps)."""


@pytest.mark.parametrize(
    ("stage1", "stage2", "chunk", "max_nodes"),
    [
        ((32, 32), (), (), 14),
        ((), (8,), (), 12),
        ((16,), (8, 8), (), 17),
        ((16,), (), (16,), 12),  # both stage-1 networks in one chain: no extra node
        ((32, 32), (), (8,), 18),  # different depths: a chain each
        ((), (), (8,), 12),
    ],
)
@pytest.mark.parametrize("deployment", [False, True])
def test_compact_graph_matches_torch_in_few_nodes(
    data: ProfileData,
    tmp_path: Path,
    stage1: tuple[int, ...],
    stage2: tuple[int, ...],
    chunk: tuple[int, ...],
    max_nodes: int,
    deployment: bool,
) -> None:
    if deployment:
        model = random_model(data, stage1, stage2, chunk, DEPLOYMENT_SHARES, **DEPLOYMENT)
    else:
        model = random_model(data, stage1, stage2, chunk)
    rows = roundtrip_rows(data.x)
    err = export_onnx(model, tmp_path / "model.onnx", rows)  # raises beyond 1e-5
    assert err <= 1e-5
    ops = optimized_nodes(tmp_path / "model.onnx", tmp_path)
    assert len(ops) <= max_nodes, ops
    assert "Slice" not in ops and "Squeeze" not in ops
    with torch.no_grad():
        alone, colocated = model(torch.tensor(rows, dtype=torch.float32))
        compact = CompactLatencyModel(model)(torch.tensor(rows, dtype=torch.float32))
    assert torch.all(torch.isfinite(compact)) and torch.all(compact > 0)
    no_ft = torch.tensor(rows[:, 6] == 0)
    assert bool(no_ft.any()) and bool((~no_ft).any())
    assert torch.equal(compact[no_ft, 0], compact[no_ft, 1])  # stage 2 == stage 1 exactly
    np.testing.assert_allclose(compact[:, 0].numpy(), alone.numpy(), rtol=1e-5)
    np.testing.assert_allclose(compact[:, 1].numpy(), colocated.numpy(), rtol=1e-5)


def test_feature_constant_in_training_does_not_blow_up() -> None:
    """The first engine profile has no prefill chunk; a row with one still gets a finite
    latency."""
    data = load_profile(DEFAULT_DATA.with_name("profile-h200-llama3-8b-engine.csv"))
    assert np.all(data.x[:, 4] == 0)
    model = random_model(data, (16,), ())
    assert torch.isinf(model.norm1.std[4])  # log_1p_prefill: constant 0 in training
    rows = torch.tensor(
        [
            DecodeIteration(8, 8 * 512, 512, p, 1.0).row() + [0.0, 1.0, 1.0, 0.0, 0.0]
            for p in (0, 512)
        ]
    )
    with torch.no_grad():
        alone, _ = model(rows)
    assert torch.all(torch.isfinite(alone)) and torch.all(alone > 0.1)


def test_runtime_buffers_chunks_and_row_counts(data: ProfileData, tmp_path: Path) -> None:
    model = random_model(data, (16,), ())
    result = TrainResult(model, RooflineBaseline(data.shape, H200), {"stage1": "mlp16"}, {})
    directory = write_artifact(result, data, tmp_path, "profile.csv", version="v1")
    assert read_metadata(directory).format == "harli-latency-predictor/2"
    wide = LatencyPredictor.load(directory)
    narrow = LatencyPredictor.load(directory, max_batch=8)
    rows = data.x[:20].astype(np.float32)
    expected = wide.predict(rows)
    for got in (narrow.predict(rows), wide.predict(rows[:3]), wide.predict(rows)):
        n = len(got[0])
        np.testing.assert_array_equal(got[0], expected[0][:n])
        np.testing.assert_array_equal(got[1], expected[1][:n])
    with torch.no_grad():
        ref = model(torch.tensor(rows))
    np.testing.assert_allclose(expected[0], ref[0].numpy(), rtol=1e-5)
    first = expected[0].copy()
    wide.predict(rows[::-1].copy())
    np.testing.assert_array_equal(first, expected[0])  # results are copies, not the buffer
    iteration = DecodeIteration.from_contexts([300] * 4, 0, 1.0)
    quantum = FinetuneQuantum(1024, 512, 16, backward=True, sm_share=1.0)
    assert wide.stage2(iteration, quantum) == narrow.stage2(iteration, quantum)
    with pytest.raises(ValueError, match="1..8 candidates"):
        narrow.score(iteration, [(1.0, quantum)] * 9)


def test_committed_format1_artifact_still_serves() -> None:
    """The first committed artifact (two [N] outputs) loads and predicts through the runtime."""
    path = artifact_dir(DEFAULT_ROOT, "h200", "llama3-8b", "v20261130T082340Z")
    predictor = LatencyPredictor.load(path)
    assert predictor.metadata.format == "harli-latency-predictor/1"
    rows = load_profile(DEFAULT_DATA).x[:16].astype(np.float32)
    alone, colocated = predictor.predict(rows)
    ref = predictor.session.run(None, {"features": rows})
    np.testing.assert_array_equal(alone, ref[0])
    np.testing.assert_array_equal(colocated, ref[1])


def test_predictor_shared_between_threads_keeps_each_callers_rows(
    data: ProfileData, tmp_path: Path
) -> None:
    import threading

    model = random_model(data, (16,), ())
    result = TrainResult(model, RooflineBaseline(data.shape, H200), {"stage1": "mlp16"}, {})
    predictor = LatencyPredictor.load(write_artifact(result, data, tmp_path, "p.csv", "v1"))
    iterations = [DecodeIteration.from_contexts([c] * b) for b, c in ((1, 64), (64, 2048))]
    expected = [predictor.stage1(it) for it in iterations]
    assert expected[0] != expected[1]
    rows = data.x[:64].astype(np.float32)
    batch = predictor.predict(rows)[0]
    wrong: list[str] = []

    def hammer(i: int) -> None:
        for _ in range(300):
            if predictor.stage1(iterations[i]) != expected[i]:
                wrong.append(f"stage1 {i}")
            if not np.array_equal(predictor.predict(rows)[0], batch):
                wrong.append(f"predict {i}")

    threads = [threading.Thread(target=hammer, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong, wrong[:5]
