"""CPU micro-benchmark: the unified pool's host work per decode iteration, `unified` against
`static_split`, in one run.

This drives the real decode engine (tiny model, CPU) over the CPU accounting pool
(`CpuPageBackend`) with a steady batch, and calls the memory adapter the way the host loop does
(`gpu_runtime.colocation.loop.HostLoop.run_iteration`): `before_decode()`, the budget read of
the iteration's context (`finetune_budget_bytes()`), the engine step, `after_decode()`,
`lent_bytes()`, and `quantum_done(...)` when a simulated quantum of `--quantum-iterations`
iterations ends (its peak is what it was told to plan for, recorded through the backend's
simulated caching allocator). The policy's figures are a GPU host's (2 MiB pages, 32 MiB map
unit, reserve 768 / 2048 pages, 512-page steps, hysteresis 50, headroom floor 1792 pages, peak
window 256). Host time of pool code is the same Python on any host; what the CUDA backend's
torch reads (`finetune_reserved_bytes`, `finetune_allocated_bytes`) cost on a GPU host is
not measured here, so the backend calls per iteration are counted instead.

    python -m bench.memory.host_hooks --iterations 1500 [--profile]

Prints microseconds per iteration of each hook (mean, p50) and backend reads per iteration, per
policy; `--json PATH` writes them. A CPU measurement of host work, not a GPU benchmark
(bench/README.md)."""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

HOOKS = ("before_decode", "budget_read", "after_decode", "lent_bytes", "quantum_done", "step")
BACKEND_READS = ("finetune_reserved_bytes", "finetune_allocated_bytes", "set_finetune_cap")
POLICIES = ("static_split", "unified")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="requests kept running")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=400)
    parser.add_argument("--pool-pages", type=int, default=32768)
    parser.add_argument("--map-unit-pages", type=int, default=16)
    parser.add_argument("--quantum-iterations", type=int, default=17)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--profile", action="store_true", help="cProfile the memory hooks")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build(policy: str, model: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    """The engine over a fresh CPU pool with `policy`'s memory configuration (as
    bench/memory/phase.py builds `unified` and `static_split`)."""
    from gpu_runtime.engine import Engine, EngineConfig
    from gpu_runtime.memory import (
        EngineMemory,
        MemoryManagerConfig,
        create_page_pool,
        engine_kv_layout,
    )

    layout = engine_kv_layout(model.config, block_size=16, dtype="float32", page_bytes=1)
    page = layout.block_bytes  # one block per page, as a Llama-3-8B block on 2 MiB pages
    pool = create_page_pool(
        device="cpu",
        pool_bytes=args.pool_pages * page,
        page_bytes=page,
        map_unit_pages=args.map_unit_pages,
        pinned_tail_pages=args.map_unit_pages,
    )
    static = policy == "static_split"
    per_request = -(-(args.prompt_len + args.output_len) // 16)
    static_pages = min(args.batch * per_request + 768, args.pool_pages // 2)
    static_pages = -(-static_pages // args.map_unit_pages) * args.map_unit_pages
    config = MemoryManagerConfig(
        reserve_low_pages=768,
        reserve_high_pages=2048,
        max_step_pages=512,
        shrink_after_iterations=10**9 if static else 50,
        grow_hold_iterations=50,
        min_decode_pages=static_pages if static else 1,
        plan_headroom_min_pages=768 + MemoryManagerConfig().max_waiting_pages,
        plan_peak_window=256,
        plan_peak_prior_blocks=0 if static else args.batch * per_request,
        reclaim_from_finetune=not static,
    )
    memory = EngineMemory.prepare(
        pool, model.config, block_size=16, kv_dtype="float32", max_model_len=512, config=config
    )
    engine = Engine(
        model,
        EngineConfig(
            block_size=16,
            max_num_seqs=max(args.batch, 8),
            max_num_batched_tokens=512,
            max_model_len=512,
            **memory.engine_config_fields(),  # type: ignore[arg-type]
        ),
        kv_storage_factory=memory.binding.storage_factory,
    )
    memory.attach(engine)
    memory.decode_ready()
    memory.manager.finetune.set_demand(args.pool_pages * page)
    return engine, memory


def _count_backend(backend: Any, counts: Counter[str]) -> None:
    """Count the backend reads (instance attributes shadow the methods)."""
    for name in BACKEND_READS:
        method = getattr(backend, name)

        def counted(*a: Any, _m: Callable[..., Any] = method, _n: str = name, **k: Any) -> Any:
            counts[_n] += 1
            return _m(*a, **k)

        setattr(backend, name, counted)


def drive(
    engine: Any, memory: Any, args: argparse.Namespace, profiler: cProfile.Profile | None
) -> dict[str, Any]:
    """`args.warmup + args.iterations` host-loop iterations; per-hook microseconds of the timed
    ones and the backend reads per iteration."""
    from gpu_runtime.engine import SamplingParams

    params = SamplingParams(
        max_tokens=args.output_len, temperature=0.0, ignore_eos=True, detokenize=False
    )
    prompt = [(7 * i) % 500 + 1 for i in range(args.prompt_len)]
    counts: Counter[str] = Counter()
    _count_backend(memory.manager.pool.backend, counts)
    busy_left = 0
    planned = 0
    memory.finetune_busy = lambda: busy_left > 0
    times: dict[str, list[float]] = {name: [] for name in HOOKS}
    moved: list[bool] = []  # per timed iteration: did the pool move pages or budget
    clock = time.perf_counter

    def timed(name: str, call: Callable[[], Any], record: bool) -> Any:
        if profiler is not None and name != "step":
            profiler.enable()
        start = clock()
        out = call()
        elapsed = clock() - start
        if profiler is not None and name != "step":
            profiler.disable()
        if record:
            times[name].append(elapsed * 1e6)
        return out

    # Stagger the batch so that requests finish (and are replaced) at a steady rate.
    for i in range(args.batch):
        engine.add_request(prompt[: 1 + i % args.prompt_len], params)
    for iteration in range(args.warmup + args.iterations):
        record = iteration >= args.warmup
        if record and iteration == args.warmup:
            counts.clear()
        if busy_left == 1:  # the quantum ends before this iteration: `_collect`
            busy_left = 0
            peak = planned

            def done(peak: int = peak) -> None:
                memory.quantum_done(peak_bytes=peak, resident_bytes=min(peak, 1 << 16))

            timed("quantum_done", done, record)
        timed("before_decode", memory.before_decode, record)
        budget = timed("budget_read", memory.finetune_budget_bytes, record)
        if busy_left == 0:  # launch a quantum planned for the budget just read
            planned = budget
            busy_left = args.quantum_iterations
        else:
            busy_left -= 1
        outputs = timed("step", engine.step, record)
        timed("after_decode", memory.after_decode, record)
        timed("lent_bytes", memory.lent_bytes, record)
        if record:
            moved.append(_moved(memory.last_before) or _moved(memory.last_after))
        for output in outputs:
            if output.finished:
                engine.add_request(prompt, params)
    n = args.iterations
    out: dict[str, Any] = {}
    for name, values in times.items():
        out[f"{name}_us_mean"] = sum(values) / n if values else 0.0
        out[f"{name}_us_p50"] = statistics.median(values) if values else 0.0
    out["memory_us_mean"] = sum(out[f"{h}_us_mean"] for h in HOOKS if h != "step")
    # Iterations in which the pool moved nothing: the per-step bookkeeping alone.
    quiet = [i for i, m in enumerate(moved) if not m]
    out["quiet_iterations"] = len(quiet)
    for name in ("before_decode", "budget_read", "after_decode"):
        values = [times[name][i] for i in quiet]
        out[f"quiet_{name}_us_mean"] = sum(values) / len(values) if values else 0.0
        out[f"quiet_{name}_us_p50"] = statistics.median(values) if values else 0.0
    for name in BACKEND_READS:
        out[f"{name}_per_iteration"] = counts[name] / n
    counters = memory.manager.counters
    out["counters"] = {
        k: v
        for k, v in counters.as_dict().items()
        if isinstance(v, int) and not k.endswith("_count")
    }
    out["usable_blocks_end"] = memory.manager.usable_blocks
    out["finetune_pages_end"] = memory.manager.pool.finetune_pages
    return out


def _moved(work: Any) -> bool:
    return bool(work.maps or work.pages_unmapped or work.budget_changes or work.flushes)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from gpu_runtime.model import build_random_model
    from gpu_runtime.model.tiny import tiny_config

    args = parse_args(argv)
    model = build_random_model(tiny_config("llama"), seed=args.seed)
    results: dict[str, Any] = {"config": vars(args), "policies": {}}
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        engine, memory = build(policy, model, args)
        profiler = cProfile.Profile() if args.profile else None
        row = drive(engine, memory, args, profiler)
        memory.manager.pool.close()
        results["policies"][policy] = row
        if profiler is not None:
            print(f"--- {policy}: memory hooks, cumulative time ---")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    print(f"{'policy':<14}" + "".join(f"{h:>15}" for h in HOOKS) + f"{'memory':>10}")
    for policy, row in results["policies"].items():
        cells = "".join(f"{row[f'{h}_us_mean']:>8.1f}/{row[f'{h}_us_p50']:<6.1f}" for h in HOOKS)
        print(f"{policy:<14}{cells}{row['memory_us_mean']:>10.1f}")
    print("(us per iteration, mean/p50; memory = every hook but the step)")
    for policy, row in results["policies"].items():
        quiet = ", ".join(
            f"{h} {row[f'quiet_{h}_us_mean']:.1f}/{row[f'quiet_{h}_us_p50']:.1f}"
            for h in ("before_decode", "budget_read", "after_decode")
        )
        print(f"{policy}: {row['quiet_iterations']} iterations without page moves: {quiet}")
    for policy, row in results["policies"].items():
        reads = ", ".join(f"{n} {row[f'{n}_per_iteration']:.2f}" for n in BACKEND_READS)
        print(f"{policy}: backend calls per iteration: {reads}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return results


if __name__ == "__main__":
    main()
