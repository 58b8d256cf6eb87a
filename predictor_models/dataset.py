"""Profiled latency data: loading, hashing, and held-out splits by configuration.

A data set is ``<stem>.csv`` written by ``predictor_models.profile`` (columns ``ROW_FIELDS``) and
``<stem>.meta.json`` (GPU, model shape, commit, how the decode workload was produced).

Held-out evaluation never splits rows of one configuration between train and test: rows are
grouped by configuration bucket (batch size, mean context and prompt-chunk tokens, each in powers
of two; no chunk is a bucket of its own), and whole buckets are held out, so the test measures
prediction for batch sizes, context lengths and chunk sizes the model has not seen together.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpu_runtime.predictor.schema import STAGE2_FEATURES, ModelShape


class DatasetError(ValueError):
    """A profile file is missing, malformed or inconsistent with its metadata."""


@dataclass
class ProfileData:
    """Rows of one profile (both stages), as arrays.

    Attributes:
        x: raw features ``[N, len(STAGE2_FEATURES)]`` (float64).
        latency_ms: measured median iteration latency ``[N]``.
        stage: 1 (decode alone) or 2 (beside a finetune quantum) ``[N]``.
        group: configuration bucket id ``[N]`` (see module docstring).
        meta: the ``.meta.json`` content; ``sha256`` of the CSV bytes.
    """

    x: np.ndarray
    latency_ms: np.ndarray
    stage: np.ndarray
    group: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    sha256: str = ""

    def __len__(self) -> int:
        return len(self.latency_ms)

    @property
    def shape(self) -> ModelShape:
        return ModelShape.from_dict(self.meta["model_shape"])

    def subset(self, index: np.ndarray) -> ProfileData:
        return ProfileData(
            self.x[index],
            self.latency_ms[index],
            self.stage[index],
            self.group[index],
            self.meta,
            self.sha256,
        )


def config_group(batch_size: float, context_mean: float, prefill_tokens: float = 0.0) -> int:
    """Bucket id of (log2 batch size, log2 mean context, log2 prompt-chunk tokens or none)."""
    chunk = 0 if prefill_tokens < 0.5 else 1 + int(math.floor(math.log2(prefill_tokens)))
    return (
        chunk * 10000
        + int(math.floor(math.log2(max(batch_size, 1.0)))) * 100
        + int(math.floor(math.log2(max(context_mean, 1.0))))
    )


def load_profile(csv_path: str | Path) -> ProfileData:
    """Read ``csv_path`` and its ``.meta.json`` (DatasetError with the reason on any problem)."""
    path = Path(csv_path)
    meta_path = path.with_suffix(".meta.json")
    if not path.is_file():
        raise DatasetError(f"profile data {path} does not exist")
    if not meta_path.is_file():
        raise DatasetError(f"profile metadata {meta_path} does not exist")
    raw = path.read_bytes()
    meta = json.loads(meta_path.read_text())
    rows = list(csv.DictReader(raw.decode().splitlines()))
    if not rows:
        raise DatasetError(f"{path} has no rows")
    missing = [c for c in (*STAGE2_FEATURES, "stage", "latency_ms") if c not in rows[0]]
    if missing:
        raise DatasetError(f"{path} lacks columns {missing}")
    try:
        x = np.array([[float(r[c]) for c in STAGE2_FEATURES] for r in rows], dtype=np.float64)
        latency = np.array([float(r["latency_ms"]) for r in rows])
        stage = np.array([int(r["stage"]) for r in rows])
    except ValueError as exc:
        raise DatasetError(f"{path}: non-numeric value: {exc}") from exc
    if not np.all(np.isfinite(x)) or not np.all(latency > 0):
        raise DatasetError(f"{path}: non-finite features or non-positive latencies")
    if set(np.unique(stage)) - {1, 2}:
        raise DatasetError(f"{path}: stages must be 1 or 2, got {sorted(set(stage))}")
    if "model_shape" not in meta:
        raise DatasetError(f"{meta_path} has no model_shape")
    group = np.array([config_group(r[0], r[2], r[4]) for r in x])
    return ProfileData(x, latency, stage, group, meta, hashlib.sha256(raw).hexdigest())


def split_by_config(
    data: ProfileData, test_fraction: float = 0.25, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) row indices; whole configuration buckets go to test until it holds at
    least ``test_fraction`` of the rows of each stage."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    groups = sorted(set(data.group.tolist()))
    random.Random(seed).shuffle(groups)
    test_groups: set[int] = set()
    for stage in (1, 2):
        mask = data.stage == stage
        total = int(mask.sum())
        for g in groups:
            held = int((mask & np.isin(data.group, list(test_groups))).sum())
            if total == 0 or held >= test_fraction * total:
                break
            if np.any(mask & (data.group == g)):
                test_groups.add(g)
    test = np.isin(data.group, list(test_groups))
    if test.all():
        raise ValueError("every configuration bucket went to test; use more data")
    return np.flatnonzero(~test), np.flatnonzero(test)


def group_folds(data: ProfileData, k: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``k`` (train, validation) splits over configuration buckets (for model selection)."""
    groups = sorted(set(data.group.tolist()))
    random.Random(seed + 1).shuffle(groups)
    folds = []
    for i in range(k):
        held = np.isin(data.group, groups[i::k])
        folds.append((np.flatnonzero(~held), np.flatnonzero(held)))
    return folds


MERGE_KEYS = ("gpu", "gpu_key", "sms", "model", "model_shape", "sharing")
"""Metadata that must agree between profiles merged into one data set."""


def merge_profiles(
    parts: list[str | Path],
    out: str | Path,
    stages: list[tuple[int, ...] | None] | None = None,
) -> ProfileData:
    """Write the rows of several profiles (same GPU, model shape, sharing) as one data set.

    ``out`` gets the CSV (the first part's columns, in order) and a ``.meta.json`` holding the
    agreed keys, each part's full metadata under ``parts`` (with its file name, sha256, row
    count and the stages kept), the parts' sources and commits (``commit`` joins them);
    DatasetError if the parts disagree or a column is missing. ``stages[i]``: keep only those
    stages' rows of part ``i`` (None: all), e.g. an older run's stage-1 rows without its
    stage-2 rows, whose finetune quanta were of another kind."""
    keep = list(stages) if stages is not None else [None] * len(parts)
    if len(keep) != len(parts):
        raise DatasetError(f"{len(keep)} stage filters for {len(parts)} parts")
    target = Path(out)
    metas, raws = [], []
    for part in parts:
        path = Path(part)
        load_profile(path)  # validates the part
        metas.append(json.loads(path.with_suffix(".meta.json").read_text()))
        raws.append(path.read_bytes())
    texts = [raw.decode() for raw in raws]
    for key in MERGE_KEYS:
        values = {json.dumps(m.get(key), sort_keys=True) for m in metas}
        if len(values) > 1:
            raise DatasetError(f"profiles disagree on {key}: {sorted(values)}")
    fields = next(csv.reader(texts[0].splitlines()))
    rows: list[dict[str, str]] = []
    kept: list[int] = []
    for part, text, wanted in zip(parts, texts, keep, strict=True):
        part_rows = list(csv.DictReader(text.splitlines()))
        missing = [f for f in fields if f not in part_rows[0]]
        if missing:
            raise DatasetError(f"{part} lacks columns {missing}")
        if wanted is not None:
            part_rows = [r for r in part_rows if int(r["stage"]) in wanted]
        kept.append(len(part_rows))
        rows += part_rows
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    meta: dict[str, Any] = {key: metas[0].get(key) for key in MERGE_KEYS}
    meta["source"] = metas[0].get("source")
    meta["sources"] = sorted({str(m.get("source")) for m in metas})
    meta["commits"] = [m.get("commit") for m in metas]
    meta["commit"] = " + ".join(str(c) for c in meta["commits"])
    meta["parts"] = [
        {
            "file": Path(p).name,
            "sha256": hashlib.sha256(raw).hexdigest(),
            "rows": len(raw.decode().strip().splitlines()) - 1,
            "stages_kept": list(wanted) if wanted is not None else [1, 2],
            "rows_kept": n_kept,
            "meta": m,
        }
        for p, raw, m, wanted, n_kept in zip(parts, raws, metas, keep, kept, strict=True)
    ]
    target.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1))
    return load_profile(target)
