"""The command line of ``bench/colocate/run.py`` (its options, defaults and their meaning)."""

from __future__ import annotations

import argparse
import os

from bench.colocate.backends import QUANTUM_EXAMPLES
from bench.colocate.report import POLICIES
from bench.common.cli_types import positive_ints
from gpu_runtime.agent.config import DEFAULT_DECODE_GROUPS
from gpu_runtime.colocation.ahead import ASYNC_SCHEDULING
from gpu_runtime.colocation.harli_config import GPU_MAX_QUANTUM_MS
from gpu_runtime.colocation.loop import LAUNCH_DURING_DECODE
from gpu_runtime.engine.config import EngineConfig


def quantum_sizes(text: str) -> tuple[int, ...]:
    """``--quantum-examples``: distinct positive sizes, ascending (``1,2,4,8``)."""
    sizes = positive_ints("--quantum-examples")(text)
    if sizes != sorted(set(sizes)):
        raise argparse.ArgumentTypeError(
            f"--quantum-examples: sizes must be distinct and ascending, got {text!r}"
        )
    return tuple(sizes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``bench/colocate/run.py``'s options (the module docstring there says what a run does)."""
    parser = argparse.ArgumentParser(
        description="Co-location on one GPU: finetune tokens/s harvested beside decode, and "
        "decode's TPOT SLO (see bench/colocate/run.py)"
    )
    parser.add_argument("--model", default="llama3-8b", help="preset: llama3-8b, qwen2.5-7b, tiny")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--traces", default="low,medium,high,bursty")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of arrivals a run")
    parser.add_argument(
        "--drain-s",
        type=float,
        default=3.0,
        help="after the arrivals, seconds a run may go on (policy unchanged) until every "
        "request has finished, so attainment judges whole requests; finetune tokens/s counts "
        "the arrival window only",
    )
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--slo-factor", type=float, default=1.5)
    parser.add_argument(
        "--slo-rule",
        choices=("p50", "attainable"),
        default="attainable",
        help="p50: SLO = factor x decode_only's TPOT p50 on medium; attainable: at least "
        "--slo-headroom x decode_only's slowest request TPOT over the traces",
    )
    parser.add_argument("--slo-headroom", type=float, default=1.1)
    parser.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=None,
        help="a fixed TPOT SLO in ms instead of the rule's (the rule's parts are still "
        "recorded): runs on different days or commits are then judged alike (the rule's SLO "
        "moves with decode_only's measured TPOT)",
    )
    parser.add_argument(
        "--engine-warmup-s", type=float, default=2.0, help="untimed decode_only before timing"
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=512,
        help="the engine's token budget of one step (decode rows + prefill chunk tokens)",
    )
    parser.add_argument(
        "--mixed-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay steps carrying prefill chunks from the engine's piecewise graphs, "
        "captured per split (EngineConfig.mixed_cuda_graphs); --no-mixed-graphs launches "
        "them eagerly",
    )
    parser.add_argument(
        "--partition-gemm-sm-target",
        action=argparse.BooleanOptionalAction,
        default=EngineConfig.partition_gemm_sm_target,
        help="decode graphs of each split plan their GEMMs for the split's SMs "
        "(EngineConfig.partition_gemm_sm_target, whose default this follows; "
        "--no-partition-gemm-sm-target: the library's own choice)",
    )
    parser.add_argument(
        "--decode-programmatic-launch-rows",
        type=int,
        default=EngineConfig.decode_programmatic_launch_rows,
        help="decode buckets of at most this many rows launch their Triton kernels as "
        "programmatic dependents (EngineConfig.decode_programmatic_launch_rows, whose default "
        "this follows; 0: never)",
    )
    parser.add_argument(
        "--launch-during-decode",
        action=argparse.BooleanOptionalAction,
        default=LAUNCH_DURING_DECODE,
        help="hand each concurrent quantum to the executor once the decode step is queued "
        "(HostLoop's launch_during_decode, whose default this follows: its host launch work "
        "overlaps the step); --no-launch-during-decode: before the step",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=ASYNC_SCHEDULING,
        help="the engine launches each decode step before reading the previous one back "
        "(EngineConfig.async_scheduling) and the loop plans the next iteration inside the "
        "step (gpu_runtime.colocation.ahead; the host agent's default, ASYNC_SCHEDULING); "
        "every policy runs so. --no-async-scheduling: synchronous steps",
    )
    parser.add_argument(
        "--decode-groups",
        default=",".join(map(str, DEFAULT_DECODE_GROUPS)),
        help="decode SMs / 8 per split (default: the host agent's)",
    )
    parser.add_argument("--ft-seq-len", type=int, default=256)
    parser.add_argument(
        "--ft-dropout", type=float, default=0.05, help="the job's LoRA dropout (platform default)"
    )
    parser.add_argument("--calibrate-s", type=float, default=8.0)
    parser.add_argument(
        "--warmup-s", type=float, default=2.0, help="discarded first use of every split"
    )
    parser.add_argument(
        "--max-quantum-ms",
        type=float,
        default=GPU_MAX_QUANTUM_MS,
        help="harli's cap on a quantum's expected duration (default: a GPU host's)",
    )
    parser.add_argument(
        "--quantum-examples",
        type=quantum_sizes,
        default=QUANTUM_EXAMPLES,
        help="quantum sizes in examples for calibration and harli, ascending (default "
        f"{','.join(map(str, QUANTUM_EXAMPLES))}); the baselines keep theirs",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="skip runs that would end past this many seconds of wall time",
    )
    parser.add_argument(
        "--simulate",
        default=None,
        help="profiler CSV: run every policy on SimulatedHost with latencies fitted to it "
        "(no GPU; the result says so)",
    )
    parser.add_argument(
        "--sim-prefill-fixed-ms",
        type=float,
        default=0.0,
        help="with --simulate: fixed cost of a step carrying a prefill chunk (an eager "
        "chunk step is launch-bound)",
    )
    parser.add_argument(
        "--sim-launch-host-ms",
        type=float,
        default=0.0,
        help="with --simulate: host time to launch a concurrent quantum, before the decode "
        "step, or beside it with --launch-during-decode (the median excess of harli's launch "
        "iterations over their step on a GPU host)",
    )
    parser.add_argument(
        "--predictor",
        default=None,
        help="trained predictor artifact directory for harli (default: fitted in the run)",
    )
    parser.add_argument(
        "--predictor-use",
        choices=("evaluate", "harli"),
        default="evaluate",
        help="evaluate: compare the artifact's stage 1 with the in-run model on decode_only's "
        "iterations; harli: harli plans with the artifact",
    )
    parser.add_argument(
        "--static-split",
        choices=("sweep", "predicted"),
        default="sweep",
        help="sweep: run every fixed split on each trace and keep the best (hindsight); "
        "predicted: the smallest split predicted to keep the SLO on decode_only's iterations",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT"))
    args = parser.parse_args(argv)
    if args.tpot_slo_ms is not None and not args.tpot_slo_ms > 0:
        parser.error(f"--tpot-slo-ms must be > 0, got {args.tpot_slo_ms}")
    if not args.sim_launch_host_ms >= 0:
        parser.error(f"--sim-launch-host-ms must be >= 0, got {args.sim_launch_host_ms}")
    if args.sim_launch_host_ms and not args.simulate:
        parser.error("--sim-launch-host-ms applies to --simulate only")
    return args
