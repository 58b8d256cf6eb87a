"""Unified memory benchmarks on an H200.

    python -m bench.memory mechanism [--out DIR]   # facts the pool is built on (about 40 s)
    python -m bench.memory trace [--duration 25 --job-pool-extra-gib 12 ...]   # 4 phases
    python -m bench.memory trace --model tiny --device cpu ...   # smoke run (see --help)

`trace` (Llama-3-8B shape, seeded random bf16 weights): a bursty decode trace (`memory-bursty`:
Poisson bursts of 45 x `--rate-scale` requests/s for 4 s, 6 s quiet; prompts log-normal median
`--prompt-median` (1536) tokens in [median/6, 2 x median], outputs median `--output-median`
(256) in [median/8, 3 x median]; seeded, identical for every phase) runs through the host loop
and the deployed engine's step shape (`--max-batched-tokens` 512, mixed-step CUDA graphs:
`--mixed-graphs`) in four phases (`--phases`, run in the order given): `decode_only` (no job,
whole device), `decode_only_split` (no job, decode on the `--decode-sms` green-context split),
`unified` and `static_split` (one LoRA job: rank 16, q/k/v/o, synthetic `--ft-seq-len`-token
examples, CUDA-graphed quanta on the split's other SMs unless `--ft-eager`, sized to the budget
they read: at most `--max-examples` examples, a safety factor that shrinks after an
out-of-memory error). `unified`: the pool moves
pages both ways, quanta planned below decode's expected reclaims (`--plan-headroom-*`).
`static_split`: decode keeps the KV peak `unified` measured (plus the low watermark; run before
`unified`: `--static-kv-peak-blocks`, else decode alone's peak) and finetuning gets the rest for
good. `unified` also plans quanta beside decode's peak over the last
`--plan-peak-window` quantum boundaries (starting from `decode_only`'s KV peak); the optional
phase `unified_no_peak` plans without that term (more memory for graphed quanta, which the next
burst may have to flush), and the optional phase `unified_release` keeps the term for the shapes
that share one graph pool but gives each larger shape a pool of its own, launched when the release
plan (growth headroom only) covers what its capture held and released between quanta when decode
grows (`graph_releases`). `--job-pool-extra-gib` sizes the two job phases' pool from
`decode_only`'s KV peak. Per phase: OOMs (finetune quanta lost to out-of-memory), dropped
requests (rejected, or lost: neither finished nor still queued/running), requests still
unfinished when `--drain` s after the last arrival ran out (a window limit, reported apart),
reclaims (p50/p99, cache flushes, taken while a quantum ran, waits), decode iteration time
(p50 with a 95% interval, p99, without prefill, the slowest iterations and what happened in
them; the whole loop iteration, pool work included), TPOT, finetune memory (budget lent,
planned for, allocator reserved: time-weighted means, max, a time series), tokens/s and the
job's graph counts; `comparisons` holds the ratios between phases. A phase given more than once
(`--phases static_split,unified_release,static_split,unified_release`) runs again with its first
run's pool, decode share and peak prior, labelled `<phase>#2`, `#3`, ... wherever phases are
named (rows, iterations, `config.phase_settings`, comparisons; the first run keeps the bare
name): each repeat over its first run is the run's own measure of noise (A/A), and
`comparisons.equal_batch` judges every A/B pairing against it (`bench/memory/equal_batch.py`;
the table printed last ends with that spread). A phase that fails becomes a row with its
error; the file is written after each phase: `memory-<gpu>-<yyyymmdd>.json`, and beside it
`memory-<gpu>-<yyyymmdd>.iterations.json`, one row per loop iteration of each phase (step,
quantum beside, what the pool did before and after the step, the allocator's segments and
device calls: `bench/memory/iterations.py`). Code: `bench/memory/args.py` (the options, the
repeats' labels), `bench/memory/trace.py` (setup, the phases in turn),
`bench/memory/trace_report.py` (result file, comparisons, table), `bench/memory/phase.py` (one
phase: build and drive), `bench/memory/phase_row.py` (a phase's row), `bench/memory/sizing.py`
(the finetune side's quantum sizing).

`mechanism` measures the CUDA virtual-memory mechanism under `gpu_runtime/memory`: map/unmap cost
per 2 MiB page (per driver call, per-page vs batched access, chunks of 2 to 128 MiB), the time
to move 1 GiB between KV and torch in both directions, that unmapped memory is usable by torch at
once (and that the finetune cap holds), whether map/unmap/empty_cache wait for in-flight kernels,
that the KV view keeps its data across remaps, and the caching allocator's cache-flush costs with
and without expandable segments. Writes `memory-mechanism-<gpu>-<yyyymmdd>.json`. Code:
`bench/memory/mechanism.py` (rows, allocator costs, the run) and
`bench/memory/mechanism_checks.py` (the driver and backend measurements).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common.provenance import ROOT
from bench.memory.args import add_trace_arguments
from bench.memory.mechanism import allocator_costs, mechanism
from bench.memory.trace import trace_benchmark


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    mech = sub.add_parser("mechanism", help="measure the CUDA VMM mechanism")
    mech.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    sub.add_parser("allocator", help="(internal) caching-allocator costs, JSON on stdout")
    tr = sub.add_parser("trace", help="unified pool vs static split on a bursty decode trace")
    add_trace_arguments(tr)
    args = parser.parse_args(argv)
    if args.command == "allocator":
        print(json.dumps(allocator_costs()))
        return 0
    if args.command == "trace":
        path = trace_benchmark(args)
        print(f"wrote {path}")
        return 0
    path = mechanism(args.out)
    print(f"wrote {path}")
    return 0
