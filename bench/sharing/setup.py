"""What ``bench/sharing/run.py`` does before it measures: ``probe`` (``--probe``: create the
partitions and check a decode-shaped bf16 GEMM on every stream, nothing timed) and
``prepare_bench``, which creates the SM partitions and the stream fallback (their creation
figures go into the run's notes), allocates the workloads, measures the bandwidth ceiling (a 2 GiB
device-to-device copy), checks the decode pass on a 48-SM partition against the default stream
(exits if they differ) and warms every stream's cuBLAS workspace."""

from __future__ import annotations

import statistics
import time
from typing import Any, NamedTuple

import torch

from bench.sharing.workloads import DECODE_BATCH, HIDDEN, INTER, Workloads, time_on
from gpu_runtime.sharing import SmPartitioner, StreamSharing


class SharingBench(NamedTuple):
    """The partitions, the workloads and the ceiling every measurement of a run shares."""

    sharing: SmPartitioner
    fallback: StreamSharing
    w: Workloads
    full_ft: torch.cuda.Stream
    """The finetune stream of the fallback's whole-GPU split (the big GEMM alone)."""
    copy_tbs: float
    """Device-to-device copy bandwidth in TB/s (read + write bytes): the decode pass's ceiling."""


def probe(groups: tuple[int, ...] | None) -> None:
    """Create the partitions, run a decode-shaped bf16 GEMM on every stream; exit 1 on error."""
    device = torch.device("cuda", 0)
    stage = "create"
    try:
        sharing = SmPartitioner(device, groups)
        x = torch.randn(DECODE_BATCH, HIDDEN, device=device, dtype=torch.bfloat16)
        w = torch.randn(HIDDEN, INTER, device=device, dtype=torch.bfloat16)
        stage = "default stream"
        reference = (x @ w).float()
        torch.cuda.synchronize()
        for k in sharing.table.choices:
            for side, stream in zip(("decode", "finetune"), sharing.partition(k), strict=True):
                stage = f"{side} stream of split {k}"
                with torch.cuda.stream(stream):
                    out = (x @ w).float()
                stream.synchronize()
                torch.testing.assert_close(out, reference, rtol=1e-2, atol=1e-1)
        sharing.close()
    except Exception as exc:
        print(f"PROBE groups={groups} FAIL at {stage}: {type(exc).__name__}: {str(exc)[:300]}")
        raise SystemExit(1) from exc
    print(f"PROBE groups={groups} OK granted={sharing.granted}")


def prepare_bench(
    device: torch.device, groups: tuple[int, ...] | None, sms: int, notes: dict[str, Any]
) -> SharingBench:
    """Partitions (``groups`` as ``--groups``; ``sms`` is the GPU's SM count), workloads and the
    bandwidth ceiling, checked and warmed; creation figures, the ceiling and the check's relative
    error go into ``notes``."""
    t0 = time.perf_counter()
    sharing = SmPartitioner(device, groups)
    notes["partition_creation_s_total"] = time.perf_counter() - t0
    notes["partition_creation_s_contexts"] = sharing.creation_s
    notes["partitions_created"] = len(sharing.table.decode_sms_options)
    notes["granted_sms"] = {str(k): v for k, v in sharing.granted.items()}
    fallback = StreamSharing(device)
    w = Workloads(device)
    full_decode, full_ft = fallback.partition(sms)

    # Bandwidth ceiling measured now: a 2 GiB device-to-device copy (read + write bytes).
    src = torch.empty(2**30, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_ms = statistics.median(time_on(full_decode, lambda: dst.copy_(src), 10))
    copy_tbs = 2 * src.numel() * 2 / copy_ms / 1e9
    notes["copy_bandwidth_tbs"] = copy_tbs

    # Correctness: the same pass on a partition stream matches the default stream.
    w.decode_pass()
    torch.cuda.synchronize()
    reference = w.out.float().clone()
    ds48 = sharing.partition(48)[0]
    with torch.cuda.stream(ds48):
        w.out.fill_(float("nan"))
        w.decode_pass()
    ds48.synchronize()
    rel = ((w.out.float() - reference).norm() / reference.norm()).item()
    notes["partition_output_rel_err"] = rel
    if not rel < 1e-2:
        raise SystemExit(f"decode pass on the 48-SM partition differs from reference: {rel}")

    for _ in range(3):  # warm every stream's cuBLAS workspace
        for k in sharing.table.choices:
            for s in sharing.partition(k):
                with torch.cuda.stream(s):
                    w.decode_pass()
                    w.big_gemm()
    torch.cuda.synchronize()
    return SharingBench(sharing, fallback, w, full_ft, copy_tbs)
