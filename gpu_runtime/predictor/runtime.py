"""ONNX Runtime inference of the two-stage latency predictor on the host CPU.

``LatencyPredictor.load(directory, model_shape=served)`` validates the artifact (files, format,
feature list, the ONNX graph's input width, the served model's shape) and opens one
single-threaded CPU session. Calls:

* ``predict(rows) -> (alone_ms, colocated_ms)`` for a ``[N, 11]`` float32 feature matrix;
* ``stage1(iteration)`` and ``stage2(iteration, quantum)`` for one row (these two bound methods
  are what ``gpu_runtime.colocation.predictor.StagedPredictorAdapter`` takes);
* ``predict_ms(iteration, quantum_or_None)``: the colocation ``DecodeLatencyModel`` protocol;
* ``score(iteration, candidates)``: colocated latency of many (decode share, quantum) choices
  for one decode iteration, in one session run.

Rows are written into a buffer allocated once (``max_batch`` rows); no per-call allocation beyond
onnxruntime's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gpu_runtime.predictor.artifact import (
    INPUT_NAME,
    OUTPUT_NAMES,
    ArtifactError,
    ArtifactMetadata,
    check_model_shape,
    read_metadata,
)
from gpu_runtime.predictor.schema import (
    NO_FINETUNE_ROW,
    STAGE1_FEATURES,
    STAGE2_FEATURES,
    DecodeIteration,
    FinetuneQuantum,
    ModelShape,
)

N_FEATURES = len(STAGE2_FEATURES)
SHARE_COLUMN = STAGE2_FEATURES.index("decode_sm_share")


class LatencyPredictor:
    """A loaded, validated predictor artifact with a CPU inference session."""

    def __init__(
        self, metadata: ArtifactMetadata, max_batch: int = 256, intra_op_threads: int = 1
    ) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(
                str(metadata.onnx_path), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ArtifactError(f"{metadata.onnx_path} cannot be loaded: {exc}") from exc
        inputs = self.session.get_inputs()
        if len(inputs) != 1 or inputs[0].name != INPUT_NAME:
            raise ArtifactError(
                f"{metadata.onnx_path} inputs {[i.name for i in inputs]}, expected [{INPUT_NAME!r}]"
            )
        width = inputs[0].shape[-1]
        if width != N_FEATURES:
            raise ArtifactError(
                f"{metadata.onnx_path} takes {width} features per row, "
                f"this runtime feeds {N_FEATURES}"
            )
        outputs = tuple(o.name for o in self.session.get_outputs())
        if outputs != OUTPUT_NAMES:
            raise ArtifactError(
                f"{metadata.onnx_path} outputs {list(outputs)}, expected {list(OUTPUT_NAMES)}"
            )
        self.metadata = metadata
        self.max_batch = max_batch
        self._buffer = np.zeros((max_batch, N_FEATURES), dtype=np.float32)
        self._outputs = list(OUTPUT_NAMES)

    @classmethod
    def load(
        cls, directory: str | Path, model_shape: ModelShape | None = None, max_batch: int = 256
    ) -> LatencyPredictor:
        """Open ``directory``; with ``model_shape``, refuse an artifact of another shape."""
        metadata = read_metadata(directory)
        if model_shape is not None:
            check_model_shape(metadata, model_shape)
        return cls(metadata, max_batch=max_batch)

    @property
    def version(self) -> str:
        return self.metadata.version

    def predict(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(alone_ms, colocated_ms), each ``[N]``, for raw feature rows ``[N, 11]``."""
        if rows.ndim != 2 or rows.shape[1] != N_FEATURES:
            raise ValueError(f"rows must be [N, {N_FEATURES}], got {tuple(rows.shape)}")
        feed = rows if rows.dtype == np.float32 else rows.astype(np.float32)
        alone, colocated = self.session.run(self._outputs, {INPUT_NAME: feed})
        return alone, colocated

    def _run(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        alone, colocated = self.session.run(self._outputs, {INPUT_NAME: self._buffer[:n]})
        return alone, colocated

    def stage1(self, iteration: DecodeIteration) -> float:
        """Decode iteration latency alone (ms)."""
        row = self._buffer[0]
        row[: len(STAGE1_FEATURES)] = iteration.row()
        row[len(STAGE1_FEATURES) :] = NO_FINETUNE_ROW
        return float(self._run(1)[0][0])

    def stage2(self, iteration: DecodeIteration, quantum: FinetuneQuantum) -> float:
        """Decode iteration latency with ``quantum`` running beside it (ms)."""
        row = self._buffer[0]
        row[: len(STAGE1_FEATURES)] = iteration.row()
        row[len(STAGE1_FEATURES) :] = quantum.row()
        return float(self._run(1)[1][0])

    def predict_ms(self, iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> float:
        """Stage 1 when ``quantum`` is None or empty, else stage 2."""
        if quantum is None or quantum.tokens == 0:
            return self.stage1(iteration)
        return self.stage2(iteration, quantum)

    def score(
        self, iteration: DecodeIteration, candidates: Sequence[tuple[float, FinetuneQuantum | None]]
    ) -> np.ndarray:
        """Colocated latency (ms) of each (decode SM share, quantum) candidate, one run.

        The iteration's own ``decode_sm_share`` is replaced by each candidate's share; a None
        quantum means decode alone on that share.
        """
        n = len(candidates)
        if not 0 < n <= self.max_batch:
            raise ValueError(f"1..{self.max_batch} candidates per call, got {n}")
        k = len(STAGE1_FEATURES)
        block = self._buffer[:n]
        block[:, :k] = iteration.row()
        for i, (share, quantum) in enumerate(candidates):
            if not 0.0 < share <= 1.0:
                raise ValueError(f"candidate {i}: decode SM share {share} not in (0, 1]")
            block[i, SHARE_COLUMN] = share
            block[i, k:] = NO_FINETUNE_ROW if quantum is None else quantum.row()
        return self._run(n)[1].copy()
