"""Paged decode attention as the engine runs it: every split count and tile, timed from CUDA
graphs, per (batch, context), against the KV floor.

The engine's decode graphs call `paged_decode_attention` once per layer with a split count fixed
per batch bucket (`choose_num_splits`). Timing one call from the host (as `--profile`'s sweep
does) mostly times the launch at small batch; here each configuration is captured as one graph
of `--layers` calls over distinct per-layer caches (more bytes than L2 holds, as in a step) and
replayed, so a figure is the kernel's device time per layer inside a graph.

    python -m bench.decode.attention [--batches 1,8,32,64,128,256]
        [--contexts 512,2048] [--splits 1,2,4,8,16,32]

Before timing, every configuration's output is checked against a float32 gather-and-softmax
reference. Writes `decode-attention-<gpu>-<yyyymmdd>.json`: one row per configuration
(`us_per_layer_p50`, `floor_us`, `bandwidth_frac`, `current`: the engine's present choice), the
fastest per (batch, context), and per batch the split count whose time summed over the contexts
is least (`best_split_per_batch`), which is what a choice fixed per bucket can use.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from bench.common.cli_types import positive_ints
from bench.common.provenance import commit_hash, write_result
from bench.common.timing import event_times
from bench.decode.engine import copy_bandwidth

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B (Qwen2.5-7B: 28 / 4)
TILES = (
    (64, 4, 3),
    (32, 4, 2),
    (64, 4, 2),
    (128, 4, 2),
    (16, 4, 2),
    (16, 2, 2),
    (32, 2, 2),
    (32, 8, 2),
)
"""block_n, warps, stages. Registers a thread, compiled by Triton 3.6 for sm_90 (Llama heads,
8 splits; `cuobjdump -res-usage`), and so programs an SM can hold: 32/4 254 (2), 64/4 255 with
136 bytes spilled (2), 16/4 112 (4), 16/2 136 (7), 32/2 255 (4), 32/8 124 (2). At b = 8 with 8
splits (512 programs) 32/4/2, the engine's split tile, runs in two waves on 132 SMs; 16/4 and
16/2 fit one."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batches", type=positive_ints("--batches"), default=[1, 8, 32, 64, 128, 256]
    )
    parser.add_argument("--contexts", type=positive_ints("--contexts"), default=[512, 2048])
    parser.add_argument("--splits", type=positive_ints("--splits"), default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--layers", type=int, default=32, help="calls per graph (one a layer)")
    parser.add_argument("--distinct", type=int, default=8, help="distinct per-layer caches")
    parser.add_argument("--reps", type=int, default=20, help="timed replays per configuration")
    parser.add_argument("--commit", default=commit_hash())
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args(argv)
    if args.layers < 1 or args.distinct < 1 or args.reps < 3:
        parser.error(
            f"--layers and --distinct must be >= 1 and --reps >= 3, got {args.layers}, "
            f"{args.distinct}, {args.reps}"
        )
    return args


def best_split_per_batch(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per batch: the (split, tile) whose time summed over the batch's contexts is least.

    Only configurations measured at every context of that batch compete (a graph's split is
    fixed per bucket, while contexts vary from step to step)."""
    contexts: dict[int, set[int]] = {}
    totals: dict[tuple[int, int, int, int, int], dict[int, float]] = {}
    for row in rows:
        contexts.setdefault(row["batch"], set()).add(row["context"])
        key = (row["batch"], row["num_splits"], row["block_n"], row["num_warps"], row["num_stages"])
        totals.setdefault(key, {})[row["context"]] = row["us_per_layer_p50"]
    best: dict[int, dict[str, Any]] = {}
    for key, per_context in sorted(totals.items()):
        batch = key[0]
        if set(per_context) != contexts[batch]:
            continue
        total = sum(per_context.values())
        if batch not in best or total < best[batch]["us_summed"]:
            best[batch] = {
                "num_splits": key[1],
                "block_n": key[2],
                "num_warps": key[3],
                "num_stages": key[4],
                "us_summed": round(total, 3),
                "us_per_context": {str(c): per_context[c] for c in sorted(per_context)},
            }
    return best


def _reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """float32 attention of one query per sequence over its paged context: [B, H, D]."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // key_cache.shape[1]
    for i in range(q.shape[0]):
        length = int(lens[i])
        blocks = table[i, : -(-length // BLOCK_SIZE)].long()
        k = key_cache[blocks].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, HEAD_DIM)[:, :length]
        v = value_cache[blocks].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, HEAD_DIM)[:, :length]
        k = k.float().repeat_interleave(group, 0)
        v = v.float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hnd->hn", q[i].float(), k) * HEAD_DIM**-0.5
        out[i] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v)
    return out


@torch.no_grad()
def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    from gpu_runtime.engine.attention.decode_split import choose_num_splits, choose_tile
    from gpu_runtime.engine.attention.triton_decode import paged_decode_attention

    device = torch.device("cuda")
    bandwidth = copy_bandwidth()
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for batch in args.batches:
        current = choose_num_splits(batch, KV_HEADS, num_sms)
        for context in args.contexts:
            per_seq = -(-context // BLOCK_SIZE)
            blocks = batch * per_seq
            caches = [
                torch.randn(
                    (blocks, 2, KV_HEADS, BLOCK_SIZE, HEAD_DIM),
                    generator=gen,
                    device=device,
                    dtype=torch.bfloat16,
                )
                for _ in range(args.distinct)
            ]
            perm = torch.randperm(blocks, generator=gen, device=device)
            table = perm.view(batch, per_seq).int()
            lens = torch.full((batch,), context, device=device, dtype=torch.int32)
            q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=device).bfloat16()
            out = torch.empty_like(q)
            reference = _reference(q, caches[0][:, 0], caches[0][:, 1], table, lens)
            kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2
            floor_us = kv_bytes / bandwidth * 1e6
            for splits in args.splits:
                if splits > -(-context // 16):
                    continue
                for block_n, warps, stages in TILES:
                    call = functools.partial(
                        paged_decode_attention,
                        block_n=block_n,
                        num_warps=warps,
                        num_stages=stages,
                        out=out,
                    )
                    got = call(q, caches[0][:, 0], caches[0][:, 1], table, lens, BLOCK_SIZE, splits)
                    error = (got.float() - reference).abs().max().item()
                    if error > 2e-2:
                        raise AssertionError(
                            f"b={batch} ctx={context} splits={splits} tile={block_n}/{warps}/"
                            f"{stages}: max error {error:.3g} against the float32 reference"
                        )
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for layer in range(args.layers):
                            cache = caches[layer % args.distinct]
                            call(q, cache[:, 0], cache[:, 1], table, lens, BLOCK_SIZE, splits)
                    times = event_times(graph.replay, args.reps + 3)[3:]
                    us = statistics.median(times) * 1e3 / args.layers
                    rows.append(
                        {
                            "batch": batch,
                            "context": context,
                            "num_splits": splits,
                            "block_n": block_n,
                            "num_warps": warps,
                            "num_stages": stages,
                            "current": splits == current
                            and (block_n, warps, stages)
                            == tuple(choose_tile(batch * KV_HEADS, splits, num_sms)),
                            "us_per_layer_p50": round(us, 3),
                            "us_per_layer_max": round(sorted(times)[-1] * 1e3 / args.layers, 3),
                            "floor_us": round(floor_us, 3),
                            "bandwidth_frac": round(floor_us / us, 4),
                            "max_abs_error": round(error, 5),
                        }
                    )
                    del graph
            del caches
            torch.cuda.empty_cache()
            fastest = min(
                (r for r in rows if r["batch"] == batch and r["context"] == context),
                key=lambda r: r["us_per_layer_p50"],
            )
            print(f"b={batch} ctx={context}: fastest {fastest}", flush=True)
    return rows, bandwidth


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode/attention.py times Triton kernels: it needs a CUDA GPU")
    rows, bandwidth = measure(args)
    best = best_split_per_batch(rows)
    fastest: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = f"{row['batch']}/{row['context']}"
        if key not in fastest or row["us_per_layer_p50"] < fastest[key]["us_per_layer_p50"]:
            fastest[key] = row
    config: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in ("commit", "out")}
    config["tiles"] = [list(t) for t in TILES]
    config["heads"] = [HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE]
    out = write_result(
        "decode-attention",
        args.out,
        torch.cuda.get_device_name(),
        torch.__version__,
        args.commit,
        copy_bandwidth_tb_s=round(bandwidth / 1e12, 4),
        config=config,
        rows=rows,
        fastest=fastest,
        best_split_per_batch={str(b): v for b, v in best.items()},
    )
    print(f"wrote {out}")
    print(f"{'batch':>5s} {'ctx':>5s} {'floor':>7s} {'current':>8s} {'fastest':>8s}  config")
    for key, row in fastest.items():
        batch, context = (int(x) for x in key.split("/"))
        now_rows = [
            r for r in rows if r["batch"] == batch and r["context"] == context and r["current"]
        ]
        current_us = now_rows[0]["us_per_layer_p50"] if now_rows else float("nan")
        print(
            f"{batch:5d} {context:5d} {row['floor_us']:7.2f} {current_us:8.2f} "
            f"{row['us_per_layer_p50']:8.2f}  splits={row['num_splits']} tile={row['block_n']}/"
            f"{row['num_warps']}/{row['num_stages']}"
        )
    for batch, choice in best.items():
        print(f"batch {batch}: best fixed split {choice}")


if __name__ == "__main__":
    main()
