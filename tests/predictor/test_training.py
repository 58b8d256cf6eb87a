"""Training, held-out evaluation, ONNX export and the runtime, on the committed H200 profile.

The data are real measurements of the decode engine (``predictor_models/data``); training uses a
reduced candidate set so the module runs in seconds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_runtime.predictor.runtime import LatencyPredictor
from gpu_runtime.predictor.schema import DecodeIteration, FinetuneQuantum
from predictor_models.dataset import ProfileData, load_profile, split_by_config
from predictor_models.export import write_artifact
from predictor_models.model import CHUNK_DERIVED, LatencyModel
from predictor_models.roofline import H200
from predictor_models.train import TrainConfig, TrainResult, share_splits, train

DATA = (
    Path(__file__).resolve().parents[2] / "predictor_models/data/profile-h200-llama3-8b-engine.csv"
)
QUICK = TrainConfig(
    stage1_candidates=(((16,), 1e-4),), stage2_candidates=(((), 1e-1),), folds=2, steps=120
)


@pytest.fixture(scope="module")
def data() -> ProfileData:
    return load_profile(DATA)


@pytest.fixture(scope="module")
def result(data: ProfileData) -> TrainResult:
    torch.set_num_threads(1)
    return train(data, QUICK)


def test_profile_is_real_engine_data(data: ProfileData) -> None:
    assert data.meta["gpu"] == "NVIDIA H200"
    assert data.meta["source"].startswith("engine:")
    assert data.shape.hidden_size == 4096 and data.shape.num_hidden_layers == 32
    assert np.sum(data.stage == 1) > 200 and np.sum(data.stage == 2) > 30
    assert len(data.sha256) == 64


def test_held_out_split_never_shares_a_configuration(data: ProfileData) -> None:
    train_idx, test_idx = split_by_config(data, 0.25, seed=0)
    assert set(data.group[train_idx]).isdisjoint(set(data.group[test_idx]))
    assert len(train_idx) + len(test_idx) == len(data)
    for stage in (1, 2):
        held = np.sum(data.stage[test_idx] == stage) / np.sum(data.stage == stage)
        assert held >= 0.25


def test_model_beats_the_roofline_on_held_out_configurations(result: TrainResult) -> None:
    for stage in ("stage1", "stage2"):
        ours, roofline = result.metrics[stage]["harli"], result.metrics[stage]["roofline"]
        assert ours["n"] > 0
        assert ours["mape"] < 0.5 * roofline["mape"], (stage, ours, roofline)
    assert result.metrics["stage1"]["harli"]["mape"] < 0.05


def test_without_finetune_stage2_equals_stage1(result: TrainResult, data: ProfileData) -> None:
    rows = torch.tensor(data.x[data.stage == 1][:32], dtype=torch.float32)
    assert torch.all(rows[:, 6] == 0)
    with torch.no_grad():
        alone, colocated = result.model(rows)
    assert torch.equal(alone, colocated)
    with_ft = torch.tensor(data.x[data.stage == 2][:8], dtype=torch.float32)
    with torch.no_grad():
        alone2, colocated2 = result.model(with_ft)
    assert torch.all(colocated2 > alone2)  # every measured co-run slowed decode down


def test_onnx_artifact_matches_torch_and_serves(
    result: TrainResult, data: ProfileData, tmp_path: Path
) -> None:
    directory = write_artifact(result, data, tmp_path, "profile.csv", version="v1")
    assert (directory / "model.onnx").is_file() and directory.name == "v1"
    predictor = LatencyPredictor.load(directory, model_shape=data.shape)
    assert predictor.metadata.raw["roundtrip_max_rel_err"] <= 1e-5
    assert predictor.metadata.raw["data"]["sha256"] == data.sha256
    rng = np.random.default_rng(1)
    rows = data.x[rng.integers(0, len(data), 64)].astype(np.float32)
    alone, colocated = predictor.predict(rows)
    with torch.no_grad():
        ref_alone, ref_colocated = result.model(torch.tensor(rows))
    np.testing.assert_allclose(alone, ref_alone.numpy(), rtol=1e-5)
    np.testing.assert_allclose(colocated, ref_colocated.numpy(), rtol=1e-5)

    iteration = DecodeIteration.from_contexts([700] * 24, 0, decode_sm_share=64 / 132)
    quantum = FinetuneQuantum(2048, 1024, 16, backward=False, sm_share=68 / 132)
    one = np.array([iteration.row() + quantum.row()], dtype=np.float32)
    assert predictor.stage1(iteration) == pytest.approx(float(predictor.predict(one)[0][0]))
    assert predictor.stage2(iteration, quantum) == pytest.approx(
        float(predictor.predict(one)[1][0])
    )
    assert predictor.predict_ms(iteration, None) == predictor.stage1(iteration)
    shares = [48 / 132, 64 / 132, 1.0]
    scored = predictor.score(iteration, [(s, quantum) for s in shares] + [(1.0, None)])
    assert scored.shape == (4,)
    assert scored[-1] == pytest.approx(
        predictor.stage1(DecodeIteration.from_contexts([700] * 24, 0, decode_sm_share=1.0))
    )
    with pytest.raises(ValueError, match="rows must be"):
        predictor.predict(np.zeros((2, 10), dtype=np.float32))
    with pytest.raises(ValueError, match="decode SM share"):
        predictor.score(iteration, [(0.0, None)])


def test_merged_profiles_keep_every_row_and_their_provenance(tmp_path: Path) -> None:
    import json
    import shutil

    from predictor_models.dataset import DatasetError, merge_profiles

    merged = merge_profiles([DATA, DATA], tmp_path / "merged.csv")
    single = load_profile(DATA)
    assert len(merged) == 2 * len(single)
    np.testing.assert_array_equal(merged.x[len(single) :], single.x)
    parts = merged.meta["parts"]
    assert [p["sha256"] for p in parts] == [single.sha256] * 2
    assert merged.meta["model_shape"] == single.meta["model_shape"]
    other = tmp_path / "other.csv"
    shutil.copy(DATA, other)
    meta = json.loads(DATA.with_suffix(".meta.json").read_text())
    meta["model_shape"]["hidden_size"] = 3584
    other.with_suffix(".meta.json").write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match="disagree on model_shape"):
        merge_profiles([DATA, other], tmp_path / "bad.csv")
    stage1_only = merge_profiles([DATA, DATA], tmp_path / "s1.csv", stages=[None, (1,)])
    n1 = int(np.sum(single.stage == 1))
    assert len(stage1_only) == len(single) + n1 and n1 < len(single)
    assert np.all(stage1_only.stage[len(single) :] == 1)
    kept = [(p["stages_kept"], p["rows_kept"]) for p in stage1_only.meta["parts"]]
    assert kept == [([1, 2], len(single)), ([1], n1)]
    with pytest.raises(DatasetError, match="1 stage filters for 2 parts"):
        merge_profiles([DATA, DATA], tmp_path / "bad.csv", stages=[None])


def test_model_choice_prefers_the_simplest_candidate_near_the_best() -> None:
    from predictor_models.train import simplest_near_best

    candidates = (((), 0.1), ((16,), 1e-4), ((32, 32), 1e-4))
    cv = {"linear@0.1": 0.060, "mlp16@0.0001": 0.0305, "mlp32x32@0.0001": 0.0300}
    assert simplest_near_best(candidates, cv, 0.03) == ((16,), 1e-4)  # 1.7% worse: simpler wins
    assert simplest_near_best(candidates, cv, 0.0) == ((32, 32), 1e-4)
    cv["mlp16@0.0001"] = 0.0320  # 6.7% worse: the best wins
    assert simplest_near_best(candidates, cv, 0.03) == ((32, 32), 1e-4)


def synthetic_deployment(n: int, seed: int = 0) -> ProfileData:
    """Stage-1 rows of a deployment with 24/48 decode buckets and mixed-step graphs: decode
    steps cost by batch bucket and context, chunk steps by token bucket and share (a law the
    features can express; checks the bucket steps and the chunk network, not the GPU). As on
    the H200 with varlen chunk attention, a chunk step on 96 SMs costs what it costs on 64."""
    rng = np.random.default_rng(seed)
    batch_buckets, token_buckets = (1, 2, 4, 8, 16, 24, 32, 48, 64), (64, 128, 256, 512)
    rows, latency = [], []
    for _ in range(n):
        batch = int(np.exp(rng.uniform(0, np.log(64))))
        mean = float(np.exp(rng.uniform(np.log(32), np.log(2048))))
        share = float(rng.choice([48, 64, 96, 132])) / 132
        prefill = (
            int(np.exp(rng.uniform(np.log(16), np.log(512 - batch)))) if rng.random() < 0.5 else 0
        )
        bucket = next(b for b in batch_buckets if b >= batch)
        if prefill:
            tokens = next(t for t in token_buckets if t >= batch + prefill)
            ms = (
                6.0 + 0.03 * tokens / min(share, 64 / 132 if share < 1 else 1) + 1e-5 * batch * mean
            )
        else:
            ms = 4.5 + 0.02 * bucket / share**0.3 + 2e-5 * batch * mean
        rows.append(
            DecodeIteration(batch, round(batch * mean), round(mean * 1.2), prefill, share).row()
            + [0.0, 1.0, 1.0, 0.0, 0.0]
        )
        latency.append(ms * float(rng.uniform(0.99, 1.01)))
    base = load_profile(DATA)
    x = np.array(rows)
    meta = {
        **base.meta,
        "engine": {
            "graph_batch_sizes": list(batch_buckets),
            "mixed_cuda_graphs": True,
            "mixed_graph_token_sizes": list(token_buckets),
        },
        "decode_sms_choices": [48, 64, 96, 132],
        "sms": 132,
    }
    from predictor_models.dataset import config_group

    group = np.array([config_group(r[0], r[2], r[4]) for r in x])
    return ProfileData(x, np.array(latency), np.ones(n, dtype=int), group, meta, "0" * 64)


def test_chunk_steps_get_their_own_network_over_the_deployments_buckets() -> None:
    torch.set_num_threads(1)
    data = synthetic_deployment(600)
    cfg = TrainConfig(
        stage1_candidates=(((16,), 1e-4),), chunk_candidates=(((16,), 1e-4),), folds=2, steps=200
    )
    result = train(data, cfg)
    assert result.model.batch_buckets == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert result.model.token_buckets == (64, 128, 256, 512)
    assert result.model.share_splits == (48 / 132, 64 / 132, 96 / 132, 1.0)
    assert result.chosen["stage1_chunk"] == "mlp16@0.0001"
    for kind in ("stage1_decode", "stage1_chunk"):
        metrics = result.metrics[kind]
        assert metrics["harli"]["n"] > 20
        assert metrics["harli"]["mape"] < 0.03, (kind, metrics)
        assert metrics["harli"]["mape"] < metrics["roofline"]["mape"]


def test_chunk_features_step_once_per_boundary_between_the_profiled_splits() -> None:
    """One 0/1 column per boundary between consecutive splits (48/64/96/132 of 132 SMs), at
    their geometric mean: 55.4, 78.4 and 112.6 SMs."""
    data = synthetic_deployment(4)
    model = LatencyModel(data.shape, H200, share_splits=share_splits(data))
    assert len(model.chunk_derived) == len(CHUNK_DERIVED) + 3
    sms = (16, 48, 55, 56, 64, 78, 79, 96, 112, 113, 132)
    rows = torch.tensor(
        [
            DecodeIteration(8, 8 * 512, 600, 100, s / 132).row() + [0.0, 1.0, 1.0, 0.0, 0.0]
            for s in sms
        ]
    )
    with torch.no_grad():
        steps = model.chunk_features(rows)[:, len(CHUNK_DERIVED) :]
    expected = [[int(s > 55.4), int(s > 78.4), int(s > 112.6)] for s in sms]
    assert steps.tolist() == expected
    assert share_splits(load_profile(DATA)) == tuple(
        s / 132 for s in (32, 48, 64, 80, 96, 112, 132)
    )
