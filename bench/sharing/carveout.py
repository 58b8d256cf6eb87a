"""Does telling cuBLAS how many SMs it has speed up GEMMs on a green-context partition?

cuBLAS picks a GEMM's kernel and tile count for the whole device (132 SMs on an H200). On a
partition of 84 or 100 SMs the same grid runs in more, partly empty waves. PyTorch can pass an
SM-count target to cuBLAS (`torch._C._set_sm_carveout_experimental(n)`: plan for the device's
SMs less `n`). This study captures the base-weight GEMMs of Llama-3-8B layers (the finetune
micro-batch's forward and input-gradient GEMMs; decode's at small batch) in CUDA graphs on each
partition's stream, with and without the target matching the partition, and replays them.

    python -m bench.sharing.carveout [--decode-groups 4,6,12] [--layers 8]

Every variant's output is checked against the same GEMMs on the whole device first. Writes
`carveout-<gpu>-<yyyymmdd>.json`: per (side, SMs, rows, BLAS library, target) the graph's time
per layer, its fraction of the whole device's speed, and the target's speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from bench.common.cli_types import positive_ints
from bench.common.provenance import commit_hash, write_result
from gpu_runtime.engine.runner_types import blas_library, sm_carveout

HIDDEN, INTERMEDIATE, Q_KV = 4096, 14336, 6144  # Llama-3-8B: q|k|v = 4096 + 2 x 1024
SHAPES = (("qkv", HIDDEN, Q_KV), ("o", HIDDEN, HIDDEN), ("gate_up", HIDDEN, 2 * INTERMEDIATE),
          ("down", INTERMEDIATE, HIDDEN))  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--decode-groups", type=positive_ints("--decode-groups"), default=[4, 6, 12]
    )
    parser.add_argument("--finetune-rows", type=int, default=1024, help="tokens a micro-batch")
    parser.add_argument("--decode-rows", type=positive_ints("--decode-rows"), default=[8, 64])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--commit", default=commit_hash())
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args(argv)
    if args.layers < 1 or args.reps < 3 or args.finetune_rows < 1:
        parser.error(
            f"need --layers >= 1, --reps >= 3, --finetune-rows >= 1; got {args.layers}, "
            f"{args.reps}, {args.finetune_rows}"
        )
    return args


@contextmanager
def sm_target(carveout: int | None, library: str) -> Iterator[None]:
    """cuBLAS plans for the device's SMs less `carveout` (None: the whole device) with the
    preferred BLAS `library`, inside the block (the engine's `blas_library` and
    `sm_carveout`)."""
    with blas_library(library), sm_carveout(carveout):
        yield


def layer_gemms(rows: int, weights: list[torch.Tensor], backward: bool) -> Callable[[], Any]:
    """One layer's base GEMMs: x @ W^T for each projection, and with `backward` also the input
    gradient dy @ W (LoRA trains no base weight, so there is no weight gradient)."""
    device, dtype = weights[0].device, weights[0].dtype
    xs = [torch.randn(rows, w.shape[1], device=device, dtype=dtype) for w in weights]
    dys = [torch.randn(rows, w.shape[0], device=device, dtype=dtype) for w in weights]
    outs: list[torch.Tensor] = []

    def run() -> list[torch.Tensor]:
        outs.clear()
        for w, x, dy in zip(weights, xs, dys, strict=True):
            outs.append(x @ w.t())
            if backward:
                outs.append(dy @ w)
        return outs

    return run


def time_graph(run: Callable[[], Any], stream: torch.cuda.Stream, layers: int, reps: int) -> float:
    """Median ms of one replay of `layers` calls of `run`, captured on `stream`."""
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(layers):
            run()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps + 3):
        with torch.cuda.stream(stream):
            start.record()
            graph.replay()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


@torch.no_grad()
def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from gpu_runtime.sharing.green import SmPartitioner

    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [
        torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * k**-0.5
        for _, k, n in SHAPES
    ]
    sharing = SmPartitioner(device, decode_groups=tuple(args.decode_groups))
    rows_out: list[dict[str, Any]] = []
    cases = [("finetune", args.finetune_rows, True)] + [
        ("decode", r, False) for r in args.decode_rows
    ]
    try:
        for side, rows, backward in cases:
            run = layer_gemms(rows, weights, backward)
            reference = [t.float() for t in run()]
            whole: dict[str, float] = {}
            side_stream = torch.cuda.Stream(device)  # graphs are not captured on the default
            for library in ("cublas", "cublaslt"):
                with sm_target(None, library):
                    whole[library] = time_graph(run, side_stream, args.layers, args.reps)
            for decode_sms in args.decode_groups:
                decode_stream, finetune_stream = sharing.partition(decode_sms * 8)
                sms = total - decode_sms * 8 if side == "finetune" else decode_sms * 8
                stream = finetune_stream if side == "finetune" else decode_stream
                for library in ("cublas", "cublaslt"):
                    for carveout in (None, total - sms):
                        with sm_target(carveout, library), torch.cuda.stream(stream):
                            got = run()
                            torch.cuda.synchronize()
                            error = max(
                                ((g.float() - r).abs().max() / r.abs().max()).item()
                                for g, r in zip(got, reference, strict=True)
                            )
                            if error > 2e-2:
                                raise AssertionError(
                                    f"{side} rows={rows} sms={sms} {library} target="
                                    f"{carveout}: relative error {error:.3g}"
                                )
                            ms = time_graph(run, stream, args.layers, args.reps)
                        rows_out.append(
                            {
                                "side": side,
                                "rows": rows,
                                "sms": sms,
                                "library": library,
                                "sm_target": None if carveout is None else total - carveout,
                                "ms_per_layer": round(ms / args.layers, 4),
                                "whole_device_ms_per_layer": round(whole[library] / args.layers, 4),
                                "fraction_of_whole": round(whole[library] / ms, 4),
                                "sm_share": round(sms / total, 4),
                                "max_rel_error": round(error, 5),
                            }
                        )
                        print(rows_out[-1], flush=True)
    finally:
        sharing.close()
    for row in rows_out:
        if row["sm_target"] is not None:
            base = next(
                r
                for r in rows_out
                if r["sm_target"] is None
                and all(r[k] == row[k] for k in ("side", "rows", "sms", "library"))
            )
            row["speedup_over_no_target"] = round(base["ms_per_layer"] / row["ms_per_layer"], 4)
    return rows_out


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench/sharing/carveout.py measures green-context partitions: it needs CUDA"
        )
    rows = measure(args)
    config = {k: v for k, v in vars(args).items() if k not in ("commit", "out")}
    config["shapes"] = [list(s) for s in SHAPES]
    gpu = torch.cuda.get_device_name()
    out = write_result(
        "carveout", args.out, gpu, torch.__version__, args.commit, config=config, rows=rows
    )
    print(f"wrote {out}")
    print(f"{'side':8s} {'rows':>5s} {'sms':>4s} {'lib':8s} {'target':>6s} {'ms/layer':>9s} "
          f"{'of whole':>8s} {'speedup':>7s}")  # fmt: skip
    for r in rows:
        print(
            f"{r['side']:8s} {r['rows']:5d} {r['sms']:4d} {r['library']:8s} "
            f"{str(r['sm_target']):>6s} {r['ms_per_layer']:9.4f} {r['fraction_of_whole']:8.3f} "
            f"{r.get('speedup_over_no_target', 1.0):7.3f}"
        )


if __name__ == "__main__":
    main()
