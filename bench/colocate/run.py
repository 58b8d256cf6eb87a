"""Co-location on one GPU: finetune tokens/s harvested beside decode, and decode's TPOT SLO.

Per model (Llama-3-8B shape by default; seeded random bf16 weights):
  1. Engine with CUDA graphs captured per (batch bucket, decode SM split), and per (token
     bucket, split) for steps carrying prefill chunks (``--mixed-graphs``, default; a step's
     token budget is ``--max-batched-tokens``). The splits come from green contexts
     (``gpu_runtime.sharing``): decode SMs in ``--decode-groups`` x 8 plus the whole device.
     One LoRA job (rank 16, alpha 32, q/k/v/o, ``--ft-seq-len``-token synthetic examples, 8
     per optimizer step) shares the serving weights.
  2. Correctness: greedy tokens of a few prompts decoded on the smallest split with a LoRA
     quantum beside them must equal those decoded alone on the whole device.
  3. Solo finetune tokens/s: quanta back to back, nothing else on the GPU.
  4. Calibration: a separate seeded high-load trace driven by ``CalibrationPolicy`` (decode
     alone on the least-sampled split, then quanta of every size beside decode on every split)
     fits the stage-1/2 model (``OnlineLatencyModel``) harli and time_slice use without an
     artifact; harli keeps it learning online during its runs. ``--predictor DIR`` evaluates
     a trained artifact beside it (``predictor_check``; ``--predictor-use harli``: harli and
     time_slice plan with it, corrected online).
  5. ``decode_only`` on every trace; the TPOT SLO = ``--slo-factor`` x decode_only's TPOT p50 on
     the ``medium`` trace, raised (``--slo-rule attainable``, default) to ``--slo-headroom`` x
     decode_only's slowest request TPOT over the traces, so decode alone meets it
     everywhere. ``static_split`` (``--static-split sweep``, default) runs every fixed split on
     each trace and keeps the best: the most finetune tokens/s among the splits keeping >= 99%
     attainment (the best fixed split, chosen with hindsight of the trace). ``time_slice``
     predicts decode steps with the same latency model as harli.
  6. Every policy on every trace (traces in bench/common/traces.py, identical for every policy):
     requests arrive on the wall clock for ``--duration`` s, then the run goes on, policy
     unchanged, until every request has finished (at most ``--drain-s`` more), so attainment
     judges whole requests; finetune tokens/s counts the arrival window.
SLO attainment is per request (mean TPOT <= SLO); TPOT p50/p99 are over token gaps; goodput is
output tokens/s of requests meeting the SLO. Run:
``python -m bench.colocate [--traces low,medium] [--policies harli,naive]``;
``--model tiny --device cpu`` is a smoke run. Writes
``<out>/colocate-<gpu>-<yyyymmdd>.json`` (and every run's iterations beside it, in
``.iterations.json``) and prints a table last.

This module runs the benchmark's phases in order; beside it: ``args`` (the command
line), ``setup`` (model, engine, LoRA job, solo finetune speed), ``backends``
(drive loop, backends, quantum warm-up), ``calibrate`` (calibration, SLO, static split,
policies), ``runs`` (one policy on one trace, the static split's sweep, the result
files rewritten after each run) and ``report`` (rows, comparisons, the table).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.colocate.args import parse_args
from bench.colocate.backends import LoopBackend
from bench.colocate.calibrate import calibrate, choose_static_split, predictor_check, tpot_slo
from bench.colocate.report import POLICIES, print_table
from bench.colocate.runs import Runs
from bench.colocate.setup import setup_engine, setup_simulation, slice_costs
from bench.common.provenance import gpu_slug
from bench.common.traces import generate, preset
from gpu_runtime.colocation import (
    DecodeOnlyPolicy,
    summarize,
)
from gpu_runtime.colocation.corrected import CorrectedLatencyModel
from gpu_runtime.colocation.harli_config import host_harli_config
from gpu_runtime.colocation.latency_model import DecodeLatencyModel
from gpu_runtime.model import ModelConfig


def main() -> None:
    args = parse_args()
    wall = time.perf_counter()
    device = torch.device(args.device)
    traces = [t for t in args.traces.split(",") if t]
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    torch.manual_seed(args.seed)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny smoke runs: threads only contend
    rank = 16
    if args.simulate:
        backend, info = setup_simulation(args, rank)
    else:
        backend, info = setup_engine(args, device, rank)
    solo_tps = float(info["solo_finetune"]["tokens_per_s_8_examples"])
    overhead_ms = float(info["solo_finetune"]["quantum_overhead_ms"])
    if isinstance(backend, LoopBackend):
        t0 = time.perf_counter()
        info["quantum_warmup"] = backend.warm_quanta(args.quantum_examples, args.ft_seq_len)
        info["quantum_warmup_s"] = round(time.perf_counter() - t0, 1)
        print(f"quanta warmed {info['quantum_warmup']}", flush=True)
    latency, calib_records, calib_info = calibrate(
        backend, args.calibrate_s, args.warmup_s, args.ft_seq_len, rank, args.quantum_examples
    )
    info["calibration"] = calib_info
    harli_latency: DecodeLatencyModel = latency
    info["harli_predictor"] = (
        "OnlineLatencyModel fitted in this run from a calibration phase (separate seeded "
        "high-load trace: decode alone on the least-sampled split, then quanta of "
        f"{list(args.quantum_examples)} examples beside decode on every split), updated online "
        "during Harli's runs"
    )
    artifact: Any = None
    if args.predictor:
        from gpu_runtime.predictor.runtime import LatencyPredictor
        from gpu_runtime.predictor.schema import ModelShape

        shape = ModelShape.from_model_config(ModelConfig.preset(args.model), args.model)
        try:
            artifact = LatencyPredictor.load(args.predictor, model_shape=shape)
        except Exception as exc:  # a bad artifact must not cost the benchmark
            info["predictor_check"] = {"error": f"{type(exc).__name__}: {exc}"}
        if artifact is None:
            pass
        elif args.predictor_use == "harli":
            corrected = CorrectedLatencyModel(artifact)
            for record in calib_records:  # this host's offsets, before any timed run
                corrected.observe_record(record, args.ft_seq_len, rank, seed=True)
            harli_latency = corrected
            info["harli_predictor"] = (
                f"trained artifact {args.predictor} (ONNX Runtime, CPU, one batched call per "
                "plan), times observed/predicted ratios per (split, quantum beside, prefill) "
                "learnt from the calibration phase and online (CorrectedLatencyModel)"
            )
            info["harli_correction_after_calibration"] = corrected.describe()
        else:
            info["harli_predictor"] += (
                f"; trained artifact {args.predictor} evaluated beside it (predictor_check), "
                "not used for decisions"
            )
    print(f"calibrated {calib_info} at {time.perf_counter() - wall:.1f}s", flush=True)
    measured = slice_costs(info["solo_finetune"].get("layer_sliced") or {})
    call_ms, forward_ms, backward_ms = measured if measured else (None, None, None)
    harli_config = replace(
        host_harli_config(device.type),  # as a runtime host of this device sets harli up
        slice_call_ms=call_ms,
        slice_forward_layer_ms=forward_ms,
        slice_backward_layer_ms=backward_ms,
        quantum_examples=args.quantum_examples,
        max_quantum_ms=args.max_quantum_ms,
        prior_quantum_overhead_ms=overhead_ms,
    )

    specs = {t: preset(t, args.duration, args.rate_scale) for t in traces}
    trace_reqs = {t: generate(spec, args.seed) for t, spec in specs.items()}
    if args.simulate:
        gpu = "none (simulation from a profile measured on " + _profile_gpu(args.simulate) + ")"
        gpu_key = "sim-" + _profile_gpu(args.simulate).lower().replace("nvidia ", "")
    else:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        gpu_key = gpu_slug(gpu)
    today = datetime.datetime.now(datetime.UTC)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"colocate-{gpu_key}-{today:%Y%m%d}.json"
    runs = Runs(
        args=args,
        backend=backend,
        specs=specs,
        trace_reqs=trace_reqs,
        traces=traces,
        harli_latency=harli_latency,
        harli_config=harli_config,
        calib_records=calib_records,
        solo_tps=solo_tps,
        rank=rank,
        info=info,
        gpu=gpu,
        created=today,
        path=path,
        wall=wall,
    )
    results, slo_parts, static_by_trace = runs.results, runs.slo_parts, runs.static_by_trace

    # Untimed: decode alone through every trace's kind of load once more (the mixed prefill +
    # decode path compiles shapes on first use; run4's first timed run had a 49 ms TPOT p50).
    t0 = time.perf_counter()
    for name in ("medium", "high"):
        spec = preset(name, duration_s=args.engine_warmup_s / 2)
        backend.run(DecodeOnlyPolicy(), generate(spec, seed=997), spec.duration_s, 1e9, False)
    info["engine_warmup_s"] = round(time.perf_counter() - t0, 1)
    slo_trace = "medium" if "medium" in traces else traces[0]
    for trace in [slo_trace] + [t for t in traces if t != slo_trace]:
        runs.run(trace, "decode_only")
        if (trace, "decode_only") not in results:
            continue
        if not latency.fitted_shares:  # calibration fitted nothing: at least the whole device
            for record in results[trace, "decode_only"][1]:
                latency.observe_record(record, args.ft_seq_len, rank)
        if trace == slo_trace:
            _, recs, s0, e0, _ = results[trace, "decode_only"]
            base = summarize(recs, 1e9, start=s0, end=e0)
            if base.tpot_ms_p50 is None:
                raise SystemExit(f"decode_only on {slo_trace} gave no TPOT sample: {base}")
            slo_parts["factor_x_medium_p50"] = args.slo_factor * base.tpot_ms_p50
    decode_only = {k[0]: v[1:] for k, v in results.items() if k[1] == "decode_only"}
    runs.slo_ms, slo_flag = tpot_slo(
        decode_only,
        slo_parts,
        slo_factor=args.slo_factor,
        slo_headroom=args.slo_headroom,
        slo_rule=args.slo_rule,
        fixed_ms=args.tpot_slo_ms,
    )
    if slo_flag is not None:
        info["slo_flag"] = slo_flag
    if artifact is not None:
        held_out = [results[t, "decode_only"][1] for t in traces if (t, "decode_only") in results]
        try:
            info["predictor_check"] = predictor_check(artifact, latency, held_out)
        except Exception as exc:
            info["predictor_check"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"predictor check {info['predictor_check']}", flush=True)
        if isinstance(harli_latency, CorrectedLatencyModel):
            # The host served decode alone before finetuning came: those iterations teach
            # the correction of decode-alone steps (its predictor_check above came first).
            for records in held_out:
                for record in records:
                    harli_latency.observe_record(record, args.ft_seq_len, rank, seed=True)
            info["harli_correction_before_runs"] = harli_latency.describe()
    for trace in traces:  # per trace: the best fixed split for it, chosen with its knowledge
        if (trace, "decode_only") in results and args.static_split == "predicted":
            static_by_trace[trace] = choose_static_split(
                harli_latency,
                backend,
                [results[trace, "decode_only"][1]],
                runs.slo_ms,
                2 * args.ft_seq_len,
                args.ft_seq_len,
                rank,
            )
    print(f"SLO {runs.slo_ms:.2f} ms ({slo_parts}); static splits {static_by_trace}", flush=True)
    runs.write()
    for trace in traces:
        for name in policies:
            if name == "static_split" and args.static_split == "sweep" and backend.choices:
                runs.sweep_static(trace)
                runs.write()
            elif name != "decode_only":
                runs.run(trace, name)
                runs.write()
    rows, comparisons = runs.write()
    print(f"wrote {path} ({time.perf_counter() - wall:.0f} s)")
    print_table(rows, comparisons, runs.slo_ms)


def _profile_gpu(path: str) -> str:
    meta = Path(path).with_suffix(".meta.json")
    if meta.exists():
        return str(json.loads(meta.read_text()).get("gpu", "unknown GPU"))
    return "unknown GPU"


def run_and_exit() -> None:
    """Green contexts must outlive every tensor, event and graph made in them, and interpreter
    teardown frees those in no set order: leave through ``os._exit`` once the result is written
    (otherwise the process can die at exit in a tensor destructor)."""
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
