"""The two workloads of ``bench/sharing/run.py`` and how they are timed: a decode-like pass (16
memory-bound ``[64, 4096] @ [4096, 14336]`` bf16 GEMMs over distinct weights) and a
finetune-like compute-bound ``8192^3`` bf16 GEMM, with per-call CUDA-event timing on one stream,
alone (``time_on``) or beside a queue of the other workload on a second stream
(``time_beside``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

HIDDEN, INTER, N_WEIGHTS, DECODE_BATCH = 4096, 14336, 16, 64
BIG = 8192


class Workloads:
    """Tensors for the decode-like pass and the big GEMM, allocated once (random, seeded)."""

    def __init__(self, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(
            DECODE_BATCH, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen
        )
        self.weights = [
            torch.randn(HIDDEN, INTER, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(N_WEIGHTS)
        ]
        self.out = torch.empty(N_WEIGHTS, DECODE_BATCH, INTER, device=device, dtype=torch.bfloat16)
        self.a = torch.randn(BIG, BIG, device=device, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(BIG, BIG, device=device, dtype=torch.bfloat16, generator=gen)
        self.c = torch.empty(BIG, BIG, device=device, dtype=torch.bfloat16)
        self.decode_bytes = (
            N_WEIGHTS * HIDDEN * INTER * 2 + N_WEIGHTS * DECODE_BATCH * (HIDDEN + INTER) * 2
        )
        self.big_flops = 2 * BIG**3

    def decode_pass(self) -> None:
        for i, w in enumerate(self.weights):
            torch.mm(self.x, w, out=self.out[i])

    def big_gemm(self) -> None:
        torch.mm(self.a, self.b, out=self.c)


def time_on(stream: torch.cuda.Stream, fn: Callable[[], object], reps: int) -> list[float]:
    """Per-call milliseconds of ``fn`` enqueued ``reps`` times on ``stream`` (CUDA events)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    with torch.cuda.stream(stream):
        events[0].record(stream)
        for i in range(reps):
            fn()
            events[i + 1].record(stream)
    stream.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(reps)]


def time_beside(
    fg_stream: torch.cuda.Stream,
    fg: Callable[[], None],
    fg_reps: int,
    bg_stream: torch.cuda.Stream,
    bg: Callable[[], None],
    bg_reps: int,
) -> list[float]:
    """Time ``fg`` while a queue of ``bg`` calls runs on ``bg_stream`` (queued first)."""
    with torch.cuda.stream(bg_stream):
        for _ in range(bg_reps):
            bg()
    times = time_on(fg_stream, fg, fg_reps)
    torch.cuda.synchronize()
    return times
