"""ONNX Runtime inference of the two-stage latency predictor on the host CPU.

``LatencyPredictor.load(directory, model_shape=served)`` validates the artifact (files, format,
feature list, the ONNX graph's input width and outputs, the served model's shape) and opens one
single-threaded CPU session (sequential, all graph optimisations, no spinning threads). Calls:

* ``predict(rows) -> (alone_ms, colocated_ms)`` for a ``[N, 11]`` feature matrix;
* ``stage1(iteration)`` and ``stage2(iteration, quantum)`` for one row (these two bound methods
  are what ``gpu_runtime.colocation.latency_model.StagedPredictorAdapter`` takes);
* ``predict_ms(iteration, quantum_or_None)``: the colocation ``DecodeLatencyModel`` protocol;
* ``score(iteration, candidates)``: colocated latency of many (decode share, quantum) choices
  for one decode iteration, in one session run.

A call costs mostly per ONNX node and per session run, not per row, so the hot path allocates
nothing: rows are written into one input buffer and the session writes into one output buffer,
both allocated once (``max_batch`` rows) and bound to the session through an IOBinding per row
count (made on first use). Larger inputs to ``predict`` run in chunks of ``max_batch``.
Calls from several threads (a host's co-location policy and its heartbeat's harvest estimate
share one predictor) are serialised by a lock around fill, run and read-back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpu_runtime.predictor.artifact import (
    INPUT_NAME,
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
N_STAGE1 = len(STAGE1_FEATURES)
SHARE_COLUMN = STAGE2_FEATURES.index("decode_sm_share")


def session_options(intra_op_threads: int = 1) -> Any:
    """CPU session options for microsecond calls: one thread, no spinning, sequential."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


class LatencyPredictor:
    """A loaded, validated predictor artifact with a CPU inference session."""

    def __init__(
        self, metadata: ArtifactMetadata, max_batch: int = 256, intra_op_threads: int = 1
    ) -> None:
        import onnxruntime as ort

        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        try:
            self.session = ort.InferenceSession(
                str(metadata.onnx_path),
                session_options(intra_op_threads),
                providers=["CPUExecutionProvider"],
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
        if outputs != metadata.outputs:
            raise ArtifactError(
                f"{metadata.onnx_path} outputs {list(outputs)}, expected {list(metadata.outputs)}"
            )
        self.metadata = metadata
        self.max_batch = max_batch
        self._rows = np.zeros((max_batch, N_FEATURES), dtype=np.float32)
        self._out = np.zeros((max_batch, 2), dtype=np.float32)  # (alone, colocated) ms
        self._runs: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()

    def _bound_run(self, n: int) -> Callable[[], None]:
        """A call that scores ``_rows[:n]`` into ``_out[:n]`` (cached per ``n``)."""
        run = self._runs.get(n)
        if run is not None:
            return run
        outputs = self.metadata.outputs
        if len(outputs) == 1:  # one [N, 2] output, written in place
            binding = self.session.io_binding()
            binding.bind_input(
                INPUT_NAME, "cpu", 0, np.float32, [n, N_FEATURES], self._rows.ctypes.data
            )
            binding.bind_output(outputs[0], "cpu", 0, np.float32, [n, 2], self._out.ctypes.data)
            session = self.session

            def run() -> None:
                session.run_with_iobinding(binding)

        else:  # format 1: two [N] outputs

            def run() -> None:
                alone, colocated = self.session.run(list(outputs), {INPUT_NAME: self._rows[:n]})
                self._out[:n, 0] = alone
                self._out[:n, 1] = colocated

        self._runs[n] = run
        return run

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
        n = len(rows)
        if n <= self.max_batch:
            with self._lock:
                np.copyto(self._rows[:n], rows)
                self._bound_run(n)()
                return self._out[:n, 0].copy(), self._out[:n, 1].copy()
        alone, colocated = np.empty(n, np.float32), np.empty(n, np.float32)
        for start in range(0, n, self.max_batch):
            part = slice(start, start + self.max_batch)
            alone[part], colocated[part] = self.predict(rows[part])
        return alone, colocated

    def stage1(self, iteration: DecodeIteration) -> float:
        """Decode iteration latency alone (ms)."""
        features = iteration.row()
        with self._lock:
            row = self._rows[0]
            row[:N_STAGE1] = features
            row[N_STAGE1:] = NO_FINETUNE_ROW
            self._bound_run(1)()
            return float(self._out[0, 0])

    def stage2(self, iteration: DecodeIteration, quantum: FinetuneQuantum) -> float:
        """Decode iteration latency with ``quantum`` running beside it (ms)."""
        features, ft = iteration.row(), quantum.row()
        with self._lock:
            row = self._rows[0]
            row[:N_STAGE1] = features
            row[N_STAGE1:] = ft
            self._bound_run(1)()
            return float(self._out[0, 1])

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
        shares = np.fromiter((share for share, _ in candidates), dtype=np.float64, count=n)
        bad = np.flatnonzero(~((shares > 0.0) & (shares <= 1.0)))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"candidate {i}: decode SM share {shares[i]} not in (0, 1]")
        ft = [NO_FINETUNE_ROW if q is None else q.row() for _, q in candidates]
        features = iteration.row()
        with self._lock:
            block = self._rows[:n]
            block[:, :N_STAGE1] = features
            block[:, SHARE_COLUMN] = shares
            block[:, N_STAGE1:] = ft
            self._bound_run(n)()
            return self._out[:n, 1].copy()
