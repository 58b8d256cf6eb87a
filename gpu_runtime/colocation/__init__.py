"""Co-location of decode and LoRA finetuning on one GPU: the host engine loop, its policies
(``decode_only``, ``naive``, ``time_slice``, ``static_split``, ``harli``) and their metrics.

Entry points: :class:`HostLoop` (owns one decode ``Engine`` and the host's finetune jobs, runs
``run_iteration()``), :class:`CoLocationPolicy` (the policy contract), :class:`IterationRecord`
(what every iteration exports), :class:`MetricsAggregator` (records to interval metrics) and
:class:`TpotWindow` (records to the heartbeat's TPOT over a recent window).
"""

from gpu_runtime.colocation.baselines import (
    DecodeOnlyPolicy,
    NaivePolicy,
    StaticSplitPolicy,
    TimeSlicePolicy,
)
from gpu_runtime.colocation.executor import (
    QuantumExecutor,
    SequentialExecutor,
    ThreadedExecutor,
)
from gpu_runtime.colocation.harli import HarliConfig, HarliPolicy, MarginTracker
from gpu_runtime.colocation.job_state import FinetuneMemory, JobError, JobState
from gpu_runtime.colocation.latency_model import (
    AnalyticLatencyModel,
    DecodeLatencyModel,
    StagedPredictorAdapter,
)
from gpu_runtime.colocation.loop import HostLoop
from gpu_runtime.colocation.metrics import IntervalMetrics, MetricsAggregator, summarize
from gpu_runtime.colocation.online import OnlineLatencyModel
from gpu_runtime.colocation.policy import CoLocationPolicy, validate_plan
from gpu_runtime.colocation.tpot_window import TpotWindow
from gpu_runtime.colocation.types import (
    DecodeSnapshot,
    FinetuneLaunch,
    FinishedRequest,
    IterationContext,
    IterationPlan,
    IterationRecord,
    JobView,
    LaunchMode,
    PlanError,
    QuantumReport,
)

__all__ = [
    "AnalyticLatencyModel",
    "CoLocationPolicy",
    "DecodeLatencyModel",
    "DecodeOnlyPolicy",
    "DecodeSnapshot",
    "FinetuneLaunch",
    "FinetuneMemory",
    "FinishedRequest",
    "HarliConfig",
    "HarliPolicy",
    "HostLoop",
    "IntervalMetrics",
    "IterationContext",
    "IterationPlan",
    "IterationRecord",
    "JobError",
    "JobState",
    "JobView",
    "LaunchMode",
    "MarginTracker",
    "MetricsAggregator",
    "NaivePolicy",
    "OnlineLatencyModel",
    "PlanError",
    "QuantumExecutor",
    "QuantumReport",
    "SequentialExecutor",
    "StagedPredictorAdapter",
    "StaticSplitPolicy",
    "ThreadedExecutor",
    "TimeSlicePolicy",
    "TpotWindow",
    "summarize",
    "validate_plan",
]
