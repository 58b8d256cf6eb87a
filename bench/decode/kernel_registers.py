"""Registers, spills and shared memory of the decode step's Triton kernels, compiled for Hopper
(sm_90) without a GPU, and so how many programs of each an SM can hold.

Usage: ``python -m bench.decode.kernel_registers [--out DIR]``. Needs ``triton`` (the
device image has it; on a machine without a GPU, ``pip install triton==3.6.0`` into any venv
with torch). Each configuration is compiled with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``; registers and stack (spills) come from ``cuobjdump
-res-usage`` on the cubin, shared memory from the compiled kernel's metadata. Programs an SM
can hold = the least of 65,536 registers / (registers rounded up to 8 x threads), 228 KB /
shared memory and 64 warps / warps. A program count above that runs in several waves.

Writes ``<out>/kernel-registers-sm90-<yyyymmdd>.json`` (the usual result keys; ``gpu`` is
"sm90": compiled for it, no GPU used) and prints a table last. This is a reading of the compiler's
output, not a timing: only the H200 benchmarks say what is faster.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common.provenance import commit_hash, write_result

REGISTERS_PER_SM = 65536
SHARED_BYTES_PER_SM = 228 * 1024
WARPS_PER_SM = 64

POINTER_TYPES = {
    "part_out_ptr": "*fp32",
    "part_lse_ptr": "*fp32",
    "block_tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "slots_ptr": "*i32",
    "slot_blocks_ptr": "*i32",
    "slot_offsets_ptr": "*i32",
    "positions_ptr": "*i64",
}
"""Pointer element types that are not the model's bf16."""
FLOAT_ARGS = {"eps", "scale"}


def signature(kernel: Any) -> dict[str, str]:
    """Triton signature of a `@triton.jit` kernel: bf16 pointers unless `POINTER_TYPES` says
    otherwise, fp32 for `FLOAT_ARGS`, i32 for every other runtime argument."""
    out = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            out[name] = "constexpr"
        elif name.endswith("_ptr"):
            out[name] = POINTER_TYPES.get(name, "*bf16")
        else:
            out[name] = "fp32" if name in FLOAT_ARGS else "i32"
    return out


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs of one kernel an SM can hold at once (module docstring)."""
    by_registers = REGISTERS_PER_SM // (((registers + 7) // 8 * 8) * 32 * warps)
    by_shared = SHARED_BYTES_PER_SM // shared if shared else WARPS_PER_SM
    return min(by_registers, by_shared, WARPS_PER_SM // warps)


def resources(cubin: bytes, cuobjdump: str) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread) of a cubin, from `cuobjdump -res-usage`."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as handle:
        handle.write(cubin)
    try:
        text = subprocess.run(
            [cuobjdump, "-res-usage", handle.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(handle.name)
    registers = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    if registers is None or stack is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text[:300]!r}")
    return int(registers.group(1)), int(stack.group(1))


def cases() -> list[tuple[str, Callable[[], Any], dict[str, Any], int, int]]:
    """(label, kernel getter, constexprs, num_warps, num_stages) for the decode step's kernels
    at Llama-3-8B's shapes (hidden 4096, 32 heads of 128, 8 KV heads, block 16)."""
    from bench.decode.attention import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, TILES
    from gpu_runtime.engine import fused_ops
    from gpu_runtime.engine.attention import triton_decode

    attention = {
        "GROUP": HEADS // KV_HEADS,
        "GROUP_PAD": 16,  # the query group padded for the tensor cores (paged_decode_attention)
        "HEAD_DIM": HEAD_DIM,
        "BLOCK_SIZE": BLOCK_SIZE,
    }
    out: list[tuple[str, Callable[[], Any], dict[str, Any], int, int]] = []
    for block_n, warps, stages in TILES:  # the tiles `bench/decode/attention.py` times
        for splits in (1, 8):
            constexprs = {**attention, "BLOCK_N": block_n, "NUM_SPLITS": splits, "USE_PDL": True}
            out.append(
                (
                    f"paged_decode {block_n}/{warps}/{stages} splits={splits}",
                    lambda: triton_decode._paged_decode_kernel,
                    constexprs,
                    warps,
                    stages,
                )
            )
    out.append(
        (
            "merge_splits splits=8",
            lambda: triton_decode._merge_splits_kernel,
            {"NUM_SPLITS": 8, "SPLITS_PAD": 8, "HEAD_DIM": HEAD_DIM, "USE_PDL": True},
            4,
            1,
        )
    )
    out.append(
        (
            "rms_norm hidden=4096",
            lambda: fused_ops._rms_norm_kernel,
            {"HAS_RESIDUAL": True, "BLOCK": 4096, "USE_PDL": True},
            8,
            1,
        )
    )
    out.append(
        (
            "silu_and_mul",
            lambda: fused_ops._silu_mul_kernel,
            {"BLOCK": 1024, "LORA_RANK": 0, "USE_PDL": True},
            4,
            1,
        )
    )
    return out


def measure(
    label: str, kernel: Any, constexprs: dict[str, Any], warps: int, stages: int
) -> dict[str, Any]:
    """Compile one configuration for sm_90 and read its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature(kernel), constexprs=constexprs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    cuobjdump = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    registers, stack = resources(compiled.asm["cubin"], cuobjdump)
    shared = int(compiled.metadata.shared)
    return {
        "kernel": label,
        "num_warps": warps,
        "num_stages": stages,
        "registers": registers,
        "stack_bytes": stack,
        "shared_bytes": shared,
        "programs_per_sm": programs_per_sm(registers, shared, warps),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default=commit_hash())
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args(argv)
    import triton

    rows = [measure(label, get(), c, w, s) for label, get, c, w, s in cases()]
    path = write_result(
        "kernel-registers",
        args.out,
        "sm90",
        torch.__version__,
        args.commit,
        config={
            "triton": triton.__version__,
            "target": "cuda sm_90, warp size 32, compiled without a GPU",
        },
        rows=rows,
    )
    print(f"wrote {path}")
    print(f"{'kernel':44s} {'warps':>5s} {'regs':>5s} {'stack':>6s} {'smem':>7s} {'per SM':>6s}")
    for r in rows:
        print(
            f"{r['kernel']:44s} {r['num_warps']:5d} {r['registers']:5d} {r['stack_bytes']:6d} "
            f"{r['shared_bytes']:7d} {r['programs_per_sm']:6d}"
        )


if __name__ == "__main__":
    main()
