"""Training and evaluation of the two-stage latency model.

``train(data)`` holds out whole configuration buckets as the test set, chooses each stage's
network (linear, or an MLP) by cross-validation over configuration buckets of the training rows,
refits the chosen networks on all training rows, and reports MAPE and p95 absolute percentage
error on the held-out rows beside the roofline-only baseline fitted on the same training rows.
Targets are log-ratios (stage 1: latency over roofline; stage 2: co-located over predicted
alone), so a squared loss on them approximates a relative-error loss.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_runtime.predictor.schema import STAGE1_FEATURES, STAGE2_FEATURES
from predictor_models.dataset import ProfileData, group_folds, split_by_config
from predictor_models.model import LatencyModel
from predictor_models.roofline import H200, Hardware, RooflineBaseline


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run.

    Attributes:
        stage1_candidates, chunk_candidates, stage2_candidates: (hidden widths, L2 weight
            penalty) pairs tried for stage 1's decode-step network, its chunk-step network and
            stage 2, simplest first; hidden ``()`` is a linear model (ridge, solved in closed
            form).
            Stage 2 has far fewer rows (each costs a finetune co-run), hence stronger penalties.
        steps: L-BFGS iterations for an MLP.
        folds: cross-validation folds (over configuration buckets) for choosing candidates.
        cv_tolerance: the first (simplest) candidate whose CV MAPE is within this relative
            margin of the best is chosen: a smaller network is cheaper per call and, at a CV
            difference this small, not measurably worse: 3-fold CV over a few dozen
            configuration buckets does not resolve 10%
            (docs/decisions/0012-latency-model.md).
        good_enough: per stage, a CV MAPE at which the simplest candidate reaching it is
            chosen outright (90% of the benchmark's targets, 3% and 5%): past the target a
            larger net buys accuracy nobody asked for and costs call time (each hidden layer
            adds ONNX nodes; the runtime's budget is 50 us per 64 rows on the host CPU).
        test_fraction: share of rows (per stage) in held-out configuration buckets.
        seed: seeds the split, the folds and the initialisation.
    """

    stage1_candidates: tuple[tuple[tuple[int, ...], float], ...] = (
        ((), 1e-4),
        ((16,), 1e-4),
        ((32,), 1e-4),
        ((32, 32), 1e-4),
    )
    chunk_candidates: tuple[tuple[tuple[int, ...], float], ...] = (
        ((), 1e-3),
        ((8,), 1e-3),
        ((16,), 1e-3),
    )
    stage2_candidates: tuple[tuple[tuple[int, ...], float], ...] = (
        ((), 1e-2),
        ((), 1e-1),
        ((8,), 1e-3),
        ((16, 16), 1e-3),
    )
    steps: int = 400
    folds: int = 3
    cv_tolerance: float = 0.10
    good_enough: dict[str, float] = field(
        default_factory=lambda: {"stage1": 0.027, "stage2": 0.045}
    )
    test_fraction: float = 0.25
    seed: int = 0


@dataclass
class TrainResult:
    """The fitted model, what was chosen, and held-out metrics per stage and predictor."""

    model: LatencyModel
    baseline: RooflineBaseline
    chosen: dict[str, str]
    metrics: dict[str, dict[str, dict[str, float]]]
    cv: dict[str, dict[str, float]] = field(default_factory=dict)
    n_train: dict[str, int] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


def error_metrics(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """MAPE and p95 absolute percentage error (fractions, 0..1) and the row count."""
    ape = np.abs(pred - true) / true
    if len(ape) == 0:
        return {"mape": float("nan"), "p95_ape": float("nan"), "n": 0}
    return {"mape": float(ape.mean()), "p95_ape": float(np.percentile(ape, 95)), "n": len(ape)}


Candidate = tuple[tuple[int, ...], float]
"""(hidden widths, L2 weight penalty) of one stage's network."""


def _name(candidate: Candidate) -> str:
    hidden, decay = candidate
    return f"{'mlp' + 'x'.join(map(str, hidden)) if hidden else 'linear'}@{decay:g}"


def _fit_net(
    net: torch.nn.Sequential, inputs: torch.Tensor, target: torch.Tensor, decay: float, steps: int
) -> None:
    """Least squares with an L2 penalty: closed form for a linear net, L-BFGS for an MLP."""
    if len(net) == 1:
        last = net[0]
        assert isinstance(last, torch.nn.Linear)
        design = torch.cat([inputs, torch.ones(len(inputs), 1)], dim=1).double()
        penalty = decay * len(inputs) * torch.eye(design.shape[1], dtype=torch.float64)
        penalty[-1, -1] = 0.0  # the intercept is not shrunk
        solution = torch.linalg.solve(design.T @ design + penalty, design.T @ target.double())
        with torch.no_grad():
            last.weight.copy_(solution[:-1].float()[None])
            last.bias.copy_(solution[-1:].float())
        return
    params = list(net.parameters())
    optimizer = torch.optim.LBFGS(
        params,
        lr=1.0,
        max_iter=steps,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        history_size=20,
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.mean((net(inputs).squeeze(-1) - target) ** 2)
        loss = loss + decay * sum((p**2).sum() for p in params if p.dim() > 1)
        loss.backward()
        return loss

    optimizer.step(closure)


def engine_buckets(data: ProfileData) -> dict[str, tuple[int, ...]]:
    """The profiled engine's decode and mixed-step token buckets (``LatencyModel`` keyword
    arguments; the defaults when the profile has no ``engine`` record)."""
    engine = data.meta.get("engine") or {}
    out: dict[str, tuple[int, ...]] = {}
    if engine.get("graph_batch_sizes"):
        out["batch_buckets"] = tuple(int(b) for b in engine["graph_batch_sizes"])
    if engine.get("mixed_cuda_graphs") and engine.get("mixed_graph_token_sizes"):
        out["token_buckets"] = tuple(int(b) for b in engine["mixed_graph_token_sizes"])
    return out


def share_splits(data: ProfileData) -> tuple[float, ...]:
    """The profiled decode SM splits as shares of the device (``LatencyModel.share_splits``),
    from the metadata's ``decode_sms_choices`` and ``sms`` (empty when not recorded)."""
    choices, sms = data.meta.get("decode_sms_choices"), data.meta.get("sms")
    if not choices or not sms:
        return ()
    return tuple(sorted({min(int(c), int(sms)) / int(sms) for c in choices}))


def chunk_rows(data: ProfileData) -> np.ndarray:
    """Rows of steps carrying prompt chunks (``LatencyModel.chunk_gate``)."""
    return np.asarray(data.x[:, STAGE2_FEATURES.index("prefill_chunk_tokens")] > 0.5)


def fit_model(
    data: ProfileData,
    stage1: Candidate,
    stage2: Candidate | None,
    cfg: TrainConfig,
    hw: Hardware = H200,
    chunk: Candidate | None = None,
) -> LatencyModel:
    """Fit stage 1's decode network on decode-only stage-1 rows and its chunk network (default
    the first chunk candidate) on stage-1 rows with prompt chunks, then (unless ``stage2`` is
    None) stage 2 on stage-2 rows."""
    torch.manual_seed(cfg.seed)
    chunk = chunk or cfg.chunk_candidates[0]
    model = LatencyModel(
        data.shape,
        hw,
        stage1[0],
        stage2[0] if stage2 else (),
        chunk_hidden=chunk[0],
        share_splits=share_splits(data),
        **engine_buckets(data),
    )
    x = torch.tensor(data.x, dtype=torch.float32)
    y = torch.tensor(data.latency_ms, dtype=torch.float32)
    is_chunk = chunk_rows(data)
    s1 = torch.tensor((data.stage == 1) & ~is_chunk)
    if not bool(s1.any()):
        raise ValueError("no decode-only stage-1 rows to train on")
    with torch.no_grad():
        f1, t_roof = model.stage1_features(x[s1])
        model.norm1.fit(f1)
        inputs1 = model.norm1(f1)
    _fit_net(model.net1, inputs1, torch.log(y[s1] / t_roof), stage1[1], cfg.steps)
    sc = torch.tensor((data.stage == 1) & is_chunk)
    if bool(sc.any()):
        with torch.no_grad():
            fc = model.chunk_features(x[sc])
            _, t_roof_c = model.stage1_features(x[sc])
            model.normc.fit(fc)
            inputs_c = model.normc(fc)
        _fit_net(model.netc, inputs_c, torch.log(y[sc] / t_roof_c), chunk[1], cfg.steps)
    s2 = torch.tensor(data.stage == 2)
    if stage2 is not None and bool(s2.any()):
        with torch.no_grad():
            alone, f1 = model.alone(x[s2], decode_net_only=True)
            predicted_alone = model.alone(x[s2])[0]
            f2 = model.stage2_features(x[s2], f1, alone)
            model.norm2.fit(f2)
            inputs2 = model.norm2(f2)
        measured = _measured_alone(data)[data.stage == 2]
        reference = torch.where(
            torch.tensor(np.isfinite(measured)),
            torch.tensor(np.nan_to_num(measured, nan=1.0), dtype=torch.float32),
            predicted_alone,
        )
        _fit_net(model.net2, inputs2, torch.log(y[s2] / reference), stage2[1], cfg.steps)
    return model.eval()


def _measured_alone(data: ProfileData) -> np.ndarray:
    """Per row, the measured stage-1 latency of the same decode configuration (NaN if none).

    The profiler times every co-run's decode configuration alone first, so stage 2 can learn
    the slowdown against a measurement rather than against stage 1's prediction."""
    key_cols = len(STAGE1_FEATURES)
    alone = {
        tuple(row[:key_cols]): latency
        for row, latency, stage in zip(data.x, data.latency_ms, data.stage, strict=True)
        if stage == 1
    }
    return np.array([alone.get(tuple(row[:key_cols]), np.nan) for row in data.x])


def predict(model: LatencyModel, x: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """Stage-appropriate prediction (ms) for each row."""
    with torch.no_grad():
        alone, colocated = model(torch.tensor(x, dtype=torch.float32))
    return np.where(stage == 1, alone.numpy(), colocated.numpy()).astype(np.float64)


def evaluate(
    model: LatencyModel, baseline: RooflineBaseline, data: ProfileData
) -> dict[str, dict[str, dict[str, float]]]:
    """Held-out metrics: ``{"stage1": {"harli": {...}, "roofline": {...}}, "stage2": ...}``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    pred = predict(model, data.x, data.stage)
    x = torch.tensor(data.x, dtype=torch.float32)
    for stage in (1, 2):
        mask = data.stage == stage
        base = baseline.predict(x[torch.tensor(mask)], stage).numpy()
        out[f"stage{stage}"] = {
            "harli": error_metrics(pred[mask], data.latency_ms[mask]),
            "roofline": error_metrics(base, data.latency_ms[mask]),
        }
    is_chunk = chunk_rows(data)
    for kind, rows in (("decode", ~is_chunk), ("chunk", is_chunk)):
        mask = (data.stage == 1) & rows
        base = baseline.predict(x[torch.tensor(mask)], 1).numpy()
        out[f"stage1_{kind}"] = {
            "harli": error_metrics(pred[mask], data.latency_ms[mask]),
            "roofline": error_metrics(base, data.latency_ms[mask]),
        }
    return out


def _cv_mape(
    data: ProfileData,
    stage: int,
    stage1: Candidate,
    stage2: Candidate | None,
    cfg: TrainConfig,
    chunk: Candidate | None = None,
    kind: str | None = None,
) -> float:
    """CV MAPE over ``stage``'s rows (``kind`` "decode" or "chunk": only those steps)."""
    errors: list[float] = []
    for train_idx, val_idx in group_folds(data, cfg.folds, cfg.seed):
        train, val = data.subset(train_idx), data.subset(val_idx)
        mask = val.stage == stage
        if kind is not None:
            mask &= chunk_rows(val) if kind == "chunk" else ~chunk_rows(val)
        if not np.any(mask) or not np.any(train.stage == stage):
            continue
        model = fit_model(train, stage1, stage2, cfg, chunk=chunk)
        pred = predict(model, val.x[mask], val.stage[mask])
        errors.extend((np.abs(pred - val.latency_ms[mask]) / val.latency_ms[mask]).tolist())
    value = float(np.mean(errors)) if errors else float("inf")
    return value if np.isfinite(value) else float("inf")


def simplest_near_best(
    candidates: tuple[Candidate, ...],
    cv: dict[str, float],
    tolerance: float,
    good_enough: float = 0.0,
) -> Candidate:
    """The first candidate (they are listed simplest first) whose CV MAPE is at most
    ``good_enough`` (a target already met: a larger net would only cost call time), else the
    first within ``tolerance`` of the best."""
    enough = next((c for c in candidates if cv[_name(c)] <= good_enough), None)
    if enough is not None:
        return enough
    best = min(cv[_name(c)] for c in candidates)
    return next(c for c in candidates if cv[_name(c)] <= best * (1.0 + tolerance))


def train(data: ProfileData, cfg: TrainConfig | None = None, hw: Hardware = H200) -> TrainResult:
    """Split by configuration, choose networks by CV, refit, evaluate (see module docstring)."""
    cfg = cfg or TrainConfig()
    train_idx, test_idx = split_by_config(data, cfg.test_fraction, cfg.seed)
    train_set, test_set = data.subset(train_idx), data.subset(test_idx)
    cv1 = {
        _name(c): _cv_mape(train_set, 1, c, None, cfg, kind="decode") for c in cfg.stage1_candidates
    }
    stage1 = simplest_near_best(
        cfg.stage1_candidates, cv1, cfg.cv_tolerance, cfg.good_enough["stage1"]
    )
    has_chunks = bool(np.any((train_set.stage == 1) & chunk_rows(train_set)))
    cvc = (
        {
            _name(c): _cv_mape(train_set, 1, stage1, None, cfg, chunk=c, kind="chunk")
            for c in cfg.chunk_candidates
        }
        if has_chunks
        else {}
    )
    chunk = (
        simplest_near_best(cfg.chunk_candidates, cvc, cfg.cv_tolerance, cfg.good_enough["stage1"])
        if has_chunks
        else cfg.chunk_candidates[0]
    )
    has_stage2 = bool(np.any(train_set.stage == 2))
    cv2 = (
        {_name(c): _cv_mape(train_set, 2, stage1, c, cfg, chunk) for c in cfg.stage2_candidates}
        if has_stage2
        else {}
    )
    stage2 = (
        simplest_near_best(cfg.stage2_candidates, cv2, cfg.cv_tolerance, cfg.good_enough["stage2"])
        if has_stage2
        else None
    )
    model = fit_model(train_set, stage1, stage2, cfg, hw, chunk)
    baseline = RooflineBaseline(data.shape, hw)
    x_train = torch.tensor(train_set.x, dtype=torch.float32)
    y_train = torch.tensor(train_set.latency_ms, dtype=torch.float32)
    for stage in (1, 2):
        mask = torch.tensor(train_set.stage == stage)
        if bool(mask.any()):
            baseline.fit(x_train[mask], y_train[mask], stage)
    return TrainResult(
        model=model,
        baseline=baseline,
        chosen={
            "stage1": _name(stage1),
            "stage1_chunk": _name(chunk) if has_chunks else "none",
            "stage2": _name(stage2) if stage2 else "none",
        },
        metrics=evaluate(model, baseline, test_set),
        cv={"stage1": cv1, "stage1_chunk": cvc, "stage2": cv2},
        n_train={f"stage{s}": int(np.sum(train_set.stage == s)) for s in (1, 2)},
        config=asdict(cfg),
    )
