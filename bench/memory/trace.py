"""`python -m bench.memory trace`: the unified pool vs a static split on a bursty decode trace
with a LoRA job (see `run.py` for the command and the figures; one phase is `phase.py`, quantum
sizing `sizing.py`)."""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from pathlib import Path
from typing import Any

from bench.common.provenance import gpu_slug
from bench.common.traces import LengthDistribution, TraceSpec, generate
from bench.memory.args import JOB_PHASES, parse_phases, phase_labels
from bench.memory.phase import run_phase
from bench.memory.sizing import finetune_footprint, lora_trainer
from bench.memory.trace_report import print_trace_table, write_trace_result

GIB = 1 << 30
MIB = 1 << 20
PAGE = 2 * MIB


def trace_spec(
    tiny: bool,
    duration_s: float,
    rate_scale: float,
    prompt_median: int = 1536,
    output_median: int = 256,
) -> Any:
    """Bursty decode load: Poisson bursts of `on_s` s, quiet `off_s` s; long prompts.

    Llama-3-8B on an H200: about 45 arrivals/s in a burst with ~5 s requests swings the decode
    batch between a handful and ~200 sequences of ~1.5k-token contexts (~50 GB of KV at peak).
    Prompts log-normal around `prompt_median` in [median/6, 2 x median], outputs around
    `output_median` in [median/8, 3 x median] (defaults: [256, 3072] and [32, 768])."""
    if tiny:
        prompt = LengthDistribution(median=48, sigma=0.4, minimum=8, maximum=120)
        output = LengthDistribution(median=16, sigma=0.4, minimum=4, maximum=40)
        return TraceSpec(
            "memory-bursty",
            "onoff",
            12.0 * rate_scale,
            duration_s,
            prompt,
            output,
            on_s=1.0,
            off_s=1.5,
        )
    prompt = LengthDistribution(
        median=prompt_median,
        sigma=0.4,
        minimum=max(prompt_median // 6, 1),
        maximum=2 * prompt_median,
    )
    output = LengthDistribution(
        median=output_median,
        sigma=0.5,
        minimum=max(output_median // 8, 1),
        maximum=3 * output_median,
    )
    return TraceSpec(
        "memory-bursty", "onoff", 45.0 * rate_scale, duration_s, prompt, output, on_s=4.0, off_s=6.0
    )


def trace_benchmark(args: Any) -> Path:
    """`decode_only` (no job, whole device: decode's own iteration time), `decode_only_split`
    (no job, on the co-located phases' decode split), `unified` (it also measures decode's KV
    peak), then `static_split` reserving that peak plus the reserve for decode and lending the
    rest to finetuning for good; `--phases` picks some, run in the order given. With
    `--job-pool-extra-gib X` the two phases with a job get a pool of the KV peak `decode_only`
    measured plus the low watermark plus X GiB (the same for both), so that memory is tight
    at decode's peak whatever the trace's load. A phase given again runs again under its
    label (`<phase>#2`, ...: bench/memory/args.py) with its first run's settings
    (`phase_settings`). A phase that fails is recorded as a row with its error; the result
    file is written after each phase."""
    import gc

    import torch

    from gpu_runtime.model import ModelConfig, build_random_model

    wall = time.perf_counter()
    phases = parse_phases(args.phases)
    # Every move and preemption is counted in the rows; per-event log lines would flood.
    logging.getLogger("gpu_runtime.memory").setLevel(logging.CRITICAL)
    device = torch.device(args.device)
    tiny = args.model == "tiny"
    config = ModelConfig.preset(args.model)
    if config.max_position_embeddings < args.max_model_len:
        config = config.replace(max_position_embeddings=args.max_model_len)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model = build_random_model(config, seed=args.seed, device=device, dtype=dtype)
    spec = trace_spec(tiny, args.duration, args.rate_scale, args.prompt_median, args.output_median)
    trace = generate(spec, args.seed)
    prompts = [r.prompt_ids(config.vocab_size) for r in trace]
    # Finetune footprint, measured once on a scratch trainer. Batches of 5 examples: quanta of
    # 1 and 4 examples never meet a batch boundary, and the second and fourth end with an
    # optimizer step (AdamW state included in what stays resident).
    allocated = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    scratch = lora_trainer(model, args, examples=64, epochs=1, batch_size=5)
    scratch._bench_allocated_at_start = allocated
    footprint_error = None
    recompute_per_token = None
    try:
        resident, per_token = finetune_footprint(scratch, args.ft_seq_len, device)
        if args.recompute != "never":  # the same job's quanta with recomputation
            again, recompute_per_token = finetune_footprint(
                scratch, args.ft_seq_len, device, recompute=True
            )
            resident = max(resident, again)
    except Exception as exc:  # size quanta from the H200 finetune bench instead: ~7 MiB/token
        footprint_error = f"{type(exc).__name__}: {exc}"
        print(f"footprint measurement failed ({footprint_error}); using 1 GiB + 8 MiB/token")
        resident, per_token = GIB, 8.0 * MIB
        recompute_per_token = None if args.recompute == "never" else 1.0 * MIB
    del scratch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    sharing, sharing_info = _sharing(args, device)
    plan: dict[str, Any] = {
        "resident_bytes": resident,
        "bytes_per_token": per_token,
        "recompute_bytes_per_token": recompute_per_token,
        "recompute": args.recompute,
        "reserve_low_pages": args.reserve_low_pages,
        "reserve_high_pages": args.reserve_high_pages,
        "step_pages": args.step_pages,
        "hysteresis": args.hysteresis,
        "cpu_page_bytes": 2
        * 16
        * config.num_hidden_layers
        * config.num_key_value_heads
        * config.head_dim
        * 4,
        "static_decode_pages": 1,
        "footprint_error": footprint_error,
        "plan_headroom_intervals": args.plan_headroom_intervals,
        "plan_headroom_min_pages": _headroom_floor(args),
        "plan_peak_window": args.plan_peak_window,
        "sharing": sharing_info,
    }
    print(
        f"setup {time.perf_counter() - wall:.1f}s: {len(trace)} requests; finetune resident "
        f"{resident / GIB:.2f} GiB, {per_token / 1024:.1f} KiB/token"
        + (
            ""
            if recompute_per_token is None
            else f" ({recompute_per_token / 1024:.1f} with recomputation)"
        ),
        flush=True,
    )
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    today = dt.datetime.now(dt.UTC)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"memory-{gpu_slug(gpu)}-{today:%Y%m%d}.json"
    rows: list[dict[str, Any]] = []
    iterations: dict[str, list[list[Any]]] = {}
    comparisons: dict[str, Any] = {}

    def phase(name: str, label: str) -> None:
        started = time.perf_counter()
        try:
            row, iterations[label] = run_phase(name, args, model, trace, prompts, plan, sharing)
            rows.append({**row, "policy": label})
        except Exception as exc:  # one phase's failure is a result; the other still runs
            import traceback

            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"
            rows.append({"model": args.model, "policy": label, "error": error})
        print(f"[{label}] {time.perf_counter() - started:.1f} s", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        comparisons.update(
            write_trace_result(path, args, spec, plan, rows, gpu, today, wall, iterations)
        )

    plan["pool_gib"] = {}
    plan["phase_settings"] = {}
    block_bytes = plan["cpu_page_bytes"] // (2 if device.type == "cuda" else 1)
    first_runs: dict[str, dict[str, Any]] = {}
    for name, label in zip(phases, phase_labels(phases), strict=True):
        if name not in first_runs:
            first_runs[name] = phase_settings(name, args, device, plan, rows, block_bytes)
        else:
            print(f"[{label}] {name} again, with its first run's settings", flush=True)
        settings = first_runs[name]
        plan.update((key, value) for key, value in settings.items() if key != "pool_gib")
        if name in plan["pool_gib"]:
            plan["pool_gib"][label] = plan["pool_gib"][name]
        plan["phase_settings"][label] = settings
        phase(name, label)
    if sharing is not None:
        sharing.close()
    print_trace_table(rows, comparisons)
    return path


def phase_settings(
    name: str,
    args: Any,
    device: Any,
    plan: dict[str, Any],
    rows: list[dict[str, Any]],
    block_bytes: int,
) -> dict[str, Any]:
    """What the first run of phase `name` is given from what the phases before it measured
    (`rows`), set in `plan`: its pool (`plan["pool_gib"][name]`, under `--job-pool-extra-gib`),
    the plan's peak prior (`unified`, `unified_release`) and static_split's decode share.
    Returns the plan values that run reads (bench/memory/phase.py): its pool in GiB, the peak
    prior (every phase's memory policy reads it; left as the phases before set it where the
    phase sets none) and for static_split its decode share. Every repeat of the phase is given
    the same, whatever ran between, so that an A/A pair differs only by when it ran."""
    if name in JOB_PHASES and args.job_pool_extra_gib is not None:
        plan["pool_gib"][name] = job_pool_gib(args, rows, block_bytes=block_bytes)
    if name in ("unified", "unified_release"):
        plan["plan_peak_prior_blocks"] = _peak_prior_blocks(args, rows)
    if name == "static_split":
        plan["static_decode_pages"] = _static_decode_pages(
            args, device, plan, rows, block_bytes=block_bytes
        )
    settings = {
        "pool_gib": float(plan["pool_gib"].get(name, args.pool_gib)),
        "plan_peak_prior_blocks": plan.get("plan_peak_prior_blocks", 0),
    }
    if name == "static_split":
        settings["static_decode_pages"] = plan["static_decode_pages"]
    return settings


def _sharing(args: Any, device: Any) -> tuple[Any, dict[str, Any] | None]:
    """The run's GPU sharing (None on CPU): green contexts with one decode split of
    `--decode-sms` SMs (falling back to prioritised streams, recorded), or streams."""
    if device.type != "cuda":
        return None, None
    from gpu_runtime.sharing import create_sharing

    prefer = "green_context" if args.sharing == "green" else "streams"
    sharing = create_sharing(device, prefer=prefer, decode_groups=(args.decode_sms // 8,))
    choices = tuple(int(c) for c in sharing.table.choices)
    if args.decode_sms not in choices:  # streams (or a split the driver refused)
        args.decode_sms = int(sharing.table.total_sms)
    info = {
        "mechanism": sharing.mechanism,
        "choices": list(choices),
        "decode_sms": args.decode_sms,
        "total_sms": int(sharing.table.total_sms),
    }
    print(f"sharing: {info}", flush=True)
    return sharing, info


def _headroom_floor(args: Any) -> int:
    if args.plan_headroom_min_pages is not None:
        return int(args.plan_headroom_min_pages)
    from gpu_runtime.memory import MemoryManagerConfig

    return int(args.reserve_low_pages + MemoryManagerConfig().max_waiting_pages)


def _decode_alone_peak_blocks(args: Any, rows: list[dict[str, Any]]) -> int | None:
    """Decode's KV peak alone on this trace, in blocks: the `decode_only` phase of this run,
    else `--decode-only-kv-peak-blocks` (from an earlier run of the same trace), else None."""
    alone = [r for r in rows if r.get("policy") == "decode_only" and "kv_peak_blocks" in r]
    if alone:
        return int(alone[0]["kv_peak_blocks"])
    given = getattr(args, "decode_only_kv_peak_blocks", None)
    return None if given is None else int(given)


def _peak_prior_blocks(args: Any, rows: list[dict[str, Any]]) -> int:
    """With `--plan-peak-prior decode_only`: decode's KV peak alone on the same trace (the
    `decode_only` phase, or `--decode-only-kv-peak-blocks`), as the first observation of the
    unified plan's peak window (what a host would carry over from its history); 0
    otherwise."""
    if args.plan_peak_prior != "decode_only" or not args.plan_peak_window:
        return 0
    return _decode_alone_peak_blocks(args, rows) or 0


def job_pool_gib(args: Any, rows: list[dict[str, Any]], *, block_bytes: int = PAGE) -> float:
    """Pool of the phases with a job under `--job-pool-extra-gib`: decode's KV peak alone
    (`decode_only`'s, else `--decode-only-kv-peak-blocks` blocks of `block_bytes`) plus the
    low watermark plus the extra, in whole GiB (`--pool-gib` at most; `--pool-gib` when
    neither is known)."""
    alone = [r for r in rows if r.get("policy") == "decode_only" and "kv_peak_gb" in r]
    if alone:
        peak_gib = alone[0]["kv_peak_gb"] * 1e9 / GIB
    else:
        blocks = _decode_alone_peak_blocks(args, rows)
        if blocks is None:
            return float(args.pool_gib)
        peak_gib = blocks * block_bytes / GIB
    reserve_gib = args.reserve_low_pages * PAGE / GIB
    return float(min(math.ceil(peak_gib + reserve_gib + args.job_pool_extra_gib), args.pool_gib))


def _static_decode_pages(
    args: Any,
    device: Any,
    plan: dict[str, Any],
    rows: list[dict[str, Any]],
    *,
    block_bytes: int = PAGE,
) -> int:
    """Decode's share under the static split: a KV peak plus the low watermark, in whole map
    units below the pinned tail. The peak: `unified`'s in this run, else
    `--static-kv-peak-blocks`, else decode alone's (`_decode_alone_peak_blocks`, blocks of
    `block_bytes`); 60% of the pool when none is known."""
    unit = 16 if device.type == "cuda" else 1
    page = PAGE if device.type == "cuda" else plan["cpu_page_bytes"]
    pool_gib = plan["pool_gib"].get("static_split", args.pool_gib)
    unified = [r for r in rows if r.get("policy") == "unified" and "kv_peak_pages" in r]
    blocks = getattr(args, "static_kv_peak_blocks", None)
    if blocks is None:
        blocks = _decode_alone_peak_blocks(args, rows)
    if unified:
        peak_pages = unified[0]["kv_peak_pages"] + args.reserve_low_pages
    elif blocks is not None:
        peak_pages = -(-int(blocks) * block_bytes // page) + args.reserve_low_pages
    else:
        peak_pages = int(pool_gib * GIB * 0.6) // page
    prefix_limit = int(pool_gib * GIB) // (page * unit) * unit - unit  # less the tail
    return min(-(-peak_pages // unit) * unit, prefix_limit)
