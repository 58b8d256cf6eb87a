"""The command line of `python -m bench.memory trace` (its options, defaults and their meaning; the
docstring of bench/memory/run.py says what a run does), and the labels its phases carry in a result.

A phase may be given more than once (`--phases static_split,unified_release,static_split,
unified_release`): its first run keeps the bare name, each repeat is labelled `<phase>#2`,
`<phase>#3`, ... in the order run (`phase_labels`), and that label keys the phase's row, its
iterations and its comparisons, so files without repeats read as before. A repeat is configured
exactly as its phase's first run (bench/memory/trace.py), so a pair of runs of one phase (an
A/A pair) differs only by when it ran: the same run's measure of noise."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Sequence

from bench.common.provenance import ROOT

PHASES = (
    "decode_only",
    "decode_only_split",
    "unified",
    "static_split",
    "unified_no_peak",
    "unified_release",
)
JOB_PHASES = ("unified", "static_split", "unified_no_peak", "unified_release")
REPEAT_MARK = "#"
"""`unified#2`: the second run of `unified` in one result."""


def parse_phases(text: str) -> list[str]:
    """`--phases`: the phases in the order given, a phase as often as given. An unknown name, a
    name carrying the repeat mark or an empty list is a ValueError that says what to give."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    marked = [name for name in names if REPEAT_MARK in name]
    if marked:
        raise ValueError(
            f"phase names {marked} carry {REPEAT_MARK!r}, which marks a repeat in the result "
            f"(unified{REPEAT_MARK}2 is unified's second run): give the bare name again instead"
        )
    unknown = sorted(set(names) - set(PHASES))
    if unknown:
        raise ValueError(f"unknown phases {unknown}; expected some of {PHASES}")
    if not names:
        raise ValueError(f"no phase given; expected some of {PHASES}")
    return names


def phases_argument(text: str) -> str:
    """argparse `type` of `--phases`: the list checked by `parse_phases` (its error becomes
    the parser's), kept as text (`config.phases` in the result) without blanks."""
    try:
        return ",".join(parse_phases(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def phase_labels(names: Sequence[str]) -> list[str]:
    """The label of each run of `names` (in order): the bare name for a phase's first run,
    `<phase>#k` for its k-th."""
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name}{REPEAT_MARK}{seen[name]}")
    return labels


def phase_of(label: str) -> str:
    """`unified#2` -> `unified`; a bare name is its own phase."""
    return label.partition(REPEAT_MARK)[0]


def occurrence_of(label: str) -> int:
    """`unified#2` -> 2; a bare name is a phase's first run (1)."""
    _, mark, number = label.partition(REPEAT_MARK)
    return int(number) if mark else 1


def occurrences(labels: Iterable[str]) -> dict[str, list[str]]:
    """Phase -> its labels among `labels`, by occurrence (phases in order of first sight)."""
    out: dict[str, list[str]] = {}
    for label in labels:
        out.setdefault(phase_of(label), []).append(label)
    return {phase: sorted(found, key=occurrence_of) for phase, found in out.items()}


def occurrence_pairs(a: Sequence[str], b: Sequence[str]) -> list[tuple[str, str]]:
    """Every pairing of a label of `a` with one of `b`: the runs of the same rank first
    (first with first, second with second, ...), then the crossed ones in order
    (`unified` with `static_split#2`, `unified#2` with `static_split`, ...)."""
    pairs = [(x, y) for i, x in enumerate(a) for j, y in enumerate(b) if i == j]
    return pairs + [(x, y) for i, x in enumerate(a) for j, y in enumerate(b) if i != j]


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m bench.memory trace`'s options on its subcommand parser."""
    parser.add_argument("--model", default="llama3-8b", help="preset: llama3-8b, qwen2.5-7b, tiny")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals a phase")
    parser.add_argument("--drain", type=float, default=30.0, help="most seconds to finish after")
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--prompt-median", type=int, default=1536, help="prompt tokens (median)")
    parser.add_argument("--output-median", type=int, default=256, help="output tokens (median)")
    parser.add_argument("--pool-gib", type=float, default=80.0, help="pool size (KV + finetune)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=512,
        help="the engine's token budget of one step (decode rows + prefill chunk tokens; the "
        "deployed engine's 512)",
    )
    parser.add_argument(
        "--mixed-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay steps carrying prefill chunks from the engine's piecewise graphs, "
        "captured on decode's split (EngineConfig.mixed_cuda_graphs, as deployed); "
        "--no-mixed-graphs launches them eagerly",
    )
    parser.add_argument(
        "--phases",
        type=phases_argument,
        default="decode_only,decode_only_split,unified,static_split",
        help="comma-separated phases, run in the order given, from "
        "decode_only, decode_only_split, unified, static_split, unified_no_peak, "
        "unified_release (unified with shapes above what fits beside decode's peak in graph "
        "pools of their own, released between quanta when decode grows). A phase uses "
        "what the phases before its first run measured: the job phases' pool and unified's "
        "peak prior decode_only's KV peak (else --decode-only-kv-peak-blocks), "
        "static_split's share unified's KV peak (else --static-kv-peak-blocks, else decode "
        "alone's). A phase given again runs again, configured as its first run, labelled "
        "<phase>#2, #3, ... in the result (the same run's A/A pairs: "
        "bench/memory/equal_batch.py reads them as noise)",
    )
    parser.add_argument(
        "--static-kv-peak-blocks",
        type=int,
        default=None,
        help="the KV peak static_split reserves for decode (plus the low watermark), from an "
        "earlier run (a unified row's kv_peak_blocks): for static_split run before unified; "
        "default: unified's peak in this run, else decode alone's KV peak",
    )
    parser.add_argument(
        "--job-pool-extra-gib",
        type=float,
        default=None,
        help="pool of the phases with a job: decode_only's KV peak + the low watermark + this "
        "(default: --pool-gib for every phase)",
    )
    parser.add_argument(
        "--decode-only-kv-peak-blocks",
        type=int,
        default=None,
        help="decode's KV peak alone on this trace, from an earlier run (its decode_only "
        "kv_peak_blocks): used for --job-pool-extra-gib and --plan-peak-prior when the "
        "decode_only phase does not run",
    )
    parser.add_argument(
        "--ft-seq-len",
        type=int,
        default=512,
        help="tokens of every synthetic finetune example (long ones, e.g. 2048, make a "
        "budget too small for one example without activation recomputation)",
    )
    parser.add_argument(
        "--recompute",
        choices=("auto", "never", "always"),
        default="auto",
        help="activation recomputation per quantum: auto, the largest shape without it that "
        "fits the budget, else the largest with it (gpu_runtime.finetune.quantum_fit); "
        "never: shapes without only (before recomputation existed); always: with only",
    )
    parser.add_argument("--max-examples", type=int, default=4, help="most examples per quantum")
    parser.add_argument(
        "--sharing",
        choices=("green", "streams"),
        default="green",
        help="green: decode on a `--decode-sms` SM partition, quanta on the rest (falls back "
        "to streams when green contexts are unavailable); streams: decode on a high-priority "
        "full-device stream, quanta on a low-priority one",
    )
    parser.add_argument("--decode-sms", type=int, default=96, help="decode's SMs beside a job")
    parser.add_argument(
        "--plan-headroom-intervals",
        type=int,
        default=4,
        help="quanta are sized to the budget less this many intervals of decode's recent "
        "growth, so most reclaims need no cache flush (MemoryManagerConfig)",
    )
    parser.add_argument(
        "--plan-headroom-min-pages",
        type=int,
        default=None,
        help="floor of that headroom (default: the low watermark plus the waiting prompts' "
        "cap, what a burst's first refill takes)",
    )
    parser.add_argument(
        "--plan-peak-window",
        type=int,
        default=256,
        help="quanta are also planned beside decode's peak over this many quantum boundaries "
        "(MemoryManagerConfig.plan_peak_window; 0: off). Phase `unified_no_peak` runs without",
    )
    parser.add_argument(
        "--plan-peak-prior",
        choices=("decode_only", "none"),
        default="decode_only",
        help="decode_only: the unified phase's peak window starts with decode_only's KV peak "
        "(the same trace; a host's history), aging out like any observation",
    )
    parser.add_argument("--reserve-low-pages", type=int, default=1024)
    parser.add_argument("--reserve-high-pages", type=int, default=3072)
    parser.add_argument(
        "--torch-headroom-gib",
        type=float,
        default=8.0,
        help="torch memory decode may add after warm-up, outside the finetune budget (the "
        "engine's eager mixed prefill+decode steps allocate GiBs at batch ~200)",
    )
    parser.add_argument(
        "--ft-eager",
        action="store_true",
        help="eager finetune quanta (default: CUDA-graphed, captured per shape on the "
        "finetune stream during warm-up; the graphs' private pool is sized into each "
        "quantum's budget and dropped by a reclaim that must flush)",
    )
    parser.add_argument("--step-pages", type=int, default=512)
    parser.add_argument("--hysteresis", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
